"""Failure behaviour on the real engine (CPU build, tiny model, ngram), with
real OTLP receivers on loopback that go away, come back, hang, or require
TLS; several engine processes; the OpenAI server stopped by SIGTERM."""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import certifi
import pytest
from engine_child import assert_delivered, run_in_child, shutdown_evidence, with_child_site
from fault_helpers import (
    ApiServer,
    EngineChild,
    clean_env,
    free_port,
    make_tls_files,
    prometheus_counters,
)
from faulty_collectors import SlowCollector

from otel_specdec._instruments import (
    ATTR_METHOD,
    ATTR_MODEL,
    ATTR_NUM_SPEC_TOKENS,
    ATTR_POSITION,
    RES_DP_RANK,
)
from otel_specdec.demo.receiver import MetricsStore, OtlpReceiver, ServerTls

pytestmark = pytest.mark.engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
POINT_KEYS = {ATTR_MODEL, ATTR_METHOD, ATTR_NUM_SPEC_TOKENS, ATTR_POSITION}
RESOURCE_KEYS = {"service.name", "service.instance.id", "process.pid", RES_DP_RANK,
                 "telemetry.sdk.language", "telemetry.sdk.name", "telemetry.sdk.version"}


def assert_nothing_from_requests(store: MetricsStore, prompts: list[str]) -> None:
    """Only the documented keys leave the process: no prompt, token or request data."""
    for series in store.series():
        assert set(series.attributes) <= POINT_KEYS, series.name
        assert set(series.resource) <= RESOURCE_KEYS, series.resource
        values = " ".join(map(str, [*series.attributes.values(), *series.resource.values()]))
        assert not any(p[:20] in values for p in prompts)


def wait_for_totals(store: MetricsStore, expected: dict, timeout: float = 20,
                    result: dict | None = None) -> None:
    """The received totals reach ``expected``; else the child's shutdown
    evidence (``result``: its run, started ``with_child_site``) is shown."""
    reached = store.wait_for(lambda: store.spec_decode_totals() == expected, timeout)
    evidence = shutdown_evidence(result, store) if result is not None else ""
    assert reached, (store.spec_decode_totals(), expected, evidence)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_collector_down_at_start_then_restarted_totals_equal_vllm(tiny_model, protocol):
    grpc_port, http_port = free_port(), free_port()
    endpoint = f"http://127.0.0.1:{grpc_port if protocol == 'grpc' else http_port}"
    child = EngineChild(
        {"model": tiny_model, "speculative_config": NGRAM, "phases": 4, "max_tokens": 32},
        clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
                  OTEL_METRIC_EXPORT_INTERVAL="300", OTEL_EXPORTER_OTLP_TIMEOUT="2"),
    )
    try:
        # Phase 0 ran with nothing listening; the collector now starts.
        counted = child.wait_pause()
        first = OtlpReceiver(grpc_port=grpc_port, http_port=http_port).start()
        wait_for_totals(first.store, counted)
        child.proceed()
        # Phase 1 ran with the collector up; it now goes away for phase 2.
        counted = child.wait_pause()
        wait_for_totals(first.store, counted)
        first.stop()
        child.proceed()
        # Phase 2 ran with the collector down; a new one (empty) starts.
        counted = child.wait_pause()
        second = OtlpReceiver(grpc_port=grpc_port, http_port=http_port).start()
        wait_for_totals(second.store, counted)
        child.proceed()
        result = child.result()
        second.stop()
    finally:
        child.kill()
    assert result["vllm"]["drafts"] > counted["drafts"] > 0
    # Cumulative totals after the outage: complete, nothing lost or doubled.
    assert second.store.spec_decode_totals() == result["vllm"]
    length = second.store.histogram_total("vllm.spec_decode.acceptance_length")
    assert length.count == result["vllm"]["drafts"]
    assert_nothing_from_requests(second.store, [])


@pytest.mark.parametrize(("drop", "multiprocessing"),
                         [("del", "1"), ("scope", "1"), ("scope", "0")])
def test_last_interval_is_flushed_when_the_llm_goes(tiny_model, drop, multiprocessing):
    """``del llm`` or the LLM going out of scope, with the engine core in its
    own process or in this one: no periodic export runs within the run, so
    every count the receiver has came with the final flush."""
    with OtlpReceiver() as receiver:
        result = run_in_child(
            {"model": tiny_model, "speculative_config": NGRAM, "drop": drop},
            with_child_site(clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint("grpc"),
                                      OTEL_METRIC_EXPORT_INTERVAL="600000",
                                      VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing)),
            timeout=420)
        assert result["vllm"]["drafts"] > 0
        wait_for_totals(receiver.store, result["vllm"], timeout=10, result=result)


def test_final_export_precedes_the_executor_teardown(tiny_model):
    """The engine core exports before it tears its executor down (a worker
    slow to exit takes up to vLLM's worker grace + 4 s, all of it inside the
    front end's wait before SIGKILL). Observed on an in-process engine core,
    where the child can note when the teardown begins."""
    with OtlpReceiver() as receiver:
        result = run_in_child(
            {"model": tiny_model, "speculative_config": NGRAM,
             "probe_executor_shutdown": True},
            clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint("grpc"),
                      OTEL_METRIC_EXPORT_INTERVAL="600000",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0"), timeout=420)
        wait_for_totals(receiver.store, result["vllm"], timeout=10)
        assert receiver.store.received_at[0] <= result["executor_shutdown_at"]


def test_llm_left_to_interpreter_exit_gets_the_grace_too(tiny_model):
    """A script that ends with its LLM still referenced: vLLM stops the engine
    from the process manager's finalizer with its 5 s default. A final
    export answered 7 s late must still arrive (the plugin's grace)."""
    with OtlpReceiver() as receiver:
        slow = SlowCollector(receiver.grpc_port, delay_s=7.0).start()
        try:
            result = run_in_child(
                {"model": tiny_model, "speculative_config": NGRAM, "drop": "exit"},
                with_child_site(clean_env(
                    OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{slow.port}",
                    OTEL_METRIC_EXPORT_INTERVAL="600000")), timeout=420)
            assert result["vllm"]["drafts"] > 0
            assert_delivered(receiver.store, result)
        finally:
            slow.stop()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> dict[str, str]:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize(("protocol", "mutual"), [("grpc", False), ("http/protobuf", True),
                                                  ("grpc", True)])
def test_tls_with_ca_file_and_client_certificates(tiny_model, tls_files, protocol, mutual):
    tls = ServerTls(tls_files["server_cert"], tls_files["server_key"],
                    client_ca_file=tls_files["ca"] if mutual else None)
    # Many container images set REQUESTS_CA_BUNDLE; the configured CA file
    # must still be the one that verifies the collector.
    env = {"OTEL_EXPORTER_OTLP_CERTIFICATE": tls_files["ca"],
           "REQUESTS_CA_BUNDLE": certifi.where(), "CURL_CA_BUNDLE": certifi.where()}
    if mutual:
        env.update(OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE=tls_files["client_cert"],
                   OTEL_EXPORTER_OTLP_CLIENT_KEY=tls_files["client_key"])
    with OtlpReceiver(tls=tls) as receiver:
        endpoint = receiver.endpoint(protocol)
        assert endpoint.startswith("https://")
        result = run_in_child(
            {"model": tiny_model, "speculative_config": NGRAM},
            with_child_site(clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                                      OTEL_EXPORTER_OTLP_PROTOCOL=protocol, **env)),
            timeout=420)
        assert_delivered(receiver.store, result)


def test_bad_endpoint_engine_runs_on_with_one_line(tiny_model):
    result = run_in_child(
        {"model": tiny_model, "speculative_config": NGRAM},
        clean_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://collector:43l7"), timeout=420)
    assert result["vllm"]["drafts"] > 0 and result["token_ids"]
    lines = [line for line in result["stderr"].splitlines() if "otel_specdec" in line]
    assert len(lines) == 1, lines
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in lines[0] and "43l7" in lines[0]


def test_two_engine_processes_export_distinct_series(tiny_model):
    """Two engines on one host under ``opentelemetry-instrument``, whose
    resource has no per-process identity: the plugin adds one."""
    launcher = (str(Path(sys.executable).with_name("opentelemetry-instrument")),)
    prompts = [["the quick brown fox jumps over the lazy dog the quick brown fox"],
               ["one two three four five one two three four five one two"]]
    with OtlpReceiver() as receiver:
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint("grpc"),
                        OTEL_SERVICE_NAME="vllm-fleet", OTEL_TRACES_EXPORTER="none",
                        OTEL_LOGS_EXPORTER="none", OTEL_METRICS_EXPORTER="otlp")
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(
                lambda p: run_in_child({"model": tiny_model, "speculative_config": NGRAM,
                                        "prompts": p}, env, launcher=launcher, timeout=420),
                prompts))
        store = receiver.store
    series = store.series("vllm.spec_decode.drafts")
    instances = {s.resource["service.instance.id"] for s in series}
    assert len(series) == len(instances) == 2
    assert {s.resource["service.name"] for s in series} == {"vllm-fleet"}
    # A backend summing the series gets the exact total of both engines.
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        assert store.spec_decode_totals()[key] == sum(r["vllm"][key] for r in results)


def test_api_server_sigterm_flushes_the_last_interval(tiny_model):
    with OtlpReceiver() as receiver:
        server = ApiServer(tiny_model, NGRAM,
                           clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint("grpc")))
        try:
            server.wait_healthy()
            for prompt in ("one two three one two three one two", "the lazy dog the lazy dog"):
                server.complete(prompt)
            vllm = prometheus_counters(server.metrics_text())
            # The default 60 s interval has not elapsed: only the flush at
            # shutdown can deliver these counts.
            assert receiver.store.spec_decode_totals()["drafts"] == 0
            assert server.terminate() < 30
        finally:
            server.kill()
        assert vllm["drafts"] > 0
        assert receiver.store.spec_decode_totals() == vllm


def test_data_parallel_engines_export_one_series_each_summing_to_vllm(tiny_model):
    """``--data-parallel-size 2``: two engine processes, two distinct series
    (instance id and DP rank), whose sum is vLLM's total over both engines;
    both flushed when the server gets SIGTERM."""
    with OtlpReceiver() as receiver:
        server = ApiServer(tiny_model, NGRAM,
                           clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint("grpc")),
                           "--data-parallel-size", "2")
        try:
            server.wait_healthy()
            prompts = ["one two three one two three one two", "the lazy dog the lazy dog",
                       "a b c a b c a b c", "red green blue red green blue"]
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(server.complete, prompts))
            vllm_text = server.metrics_text()
            assert server.terminate() < 40
        finally:
            server.kill()
        vllm = prometheus_counters(vllm_text)
        engines = set(re.findall(r'^vllm:spec_decode_num_drafts_total\{[^}]*engine="(\d+)"',
                                 vllm_text, re.MULTILINE))
        assert engines == {"0", "1"}
        series = receiver.store.series("vllm.spec_decode.drafts")
        assert sorted(s.resource[RES_DP_RANK] for s in series) == [0, 1], server.log_tail()
        assert len({s.resource["service.instance.id"] for s in series}) == 2
        assert vllm["drafts"] > 0
        assert receiver.store.spec_decode_totals() == vllm
