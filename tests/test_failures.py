"""Failure behaviour where it is decided: vLLM's real scheduler, driven by
the harness, with bad settings, injected failures, a changed vLLM, a fork.

The end-to-end counterparts (collector down, hung, TLS, several engines,
SIGTERM) are in ``test_failures_engine.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import pytest
from otel_helpers import points, total
from scheduler_harness import SchedulerHarness, build_scheduler

from otel_specdec import SpecDecodeInstrumentor, _patch, _runtime, _vllm_compat
from otel_specdec._accounting import StepAccountant
from otel_specdec._instruments import (
    ATTR_METHOD,
    ATTR_MODEL,
    ATTR_NUM_SPEC_TOKENS,
    ATTR_POSITION,
    MAX_MODEL_NAME_LEN,
)
from otel_specdec._totals import SpecDecodeTotals
from otel_specdec.demo.receiver import OtlpReceiver

K = 3
SECRET = "s3cr3t-t0ken"


def drafts_of_three(_req_id: str) -> list[int]:
    return [21, 22, 23]


def accept_one(_req_id: str, _drafts: list[int]) -> int:
    return 1


def plugin_records(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[Any]:
    return [r for r in caplog.records if r.name.startswith("otel_specdec") and r.levelno >= level]


def run_steps(model: str, steps: int = 6) -> SchedulerHarness:
    harness = SchedulerHarness(build_scheduler(model, K))
    harness.add_requests(4)
    for _ in range(steps):
        harness.step(accept_one, drafts_of_three)
    return harness


# --- Bad configuration -------------------------------------------------------

BAD_SETTINGS = [
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:43l7", "43l7"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://collector:4317", "ftp://collector:4317"),
    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "collector", "'collector'"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://", "'http://'"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "http/json"),
    ("OTEL_METRICS_EXPORTER", "otlp,zipkin", "otlp,zipkin"),
    ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem", "/nonexistent/ca.pem"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "brotli", "brotli"),
    ("OTEL_EXPORTER_OTLP_INSECURE", "yes", "yes"),
]


@pytest.mark.parametrize(("variable", "value", "shown"), BAD_SETTINGS)
def test_bad_setting_one_line_and_the_scheduler_runs_on(
        tiny_model, env_provider, caplog, variable, value, shown):
    env_provider.setenv(variable, value)
    with caplog.at_level(logging.INFO, logger="otel_specdec"):
        harness = run_steps(tiny_model)
    [record] = plugin_records(caplog, logging.INFO)
    message = record.getMessage()
    assert record.levelno == logging.ERROR
    assert variable in message and shown in message
    assert "disabled" in message
    assert record.exc_info is None  # one line, no traceback
    assert harness.vllm.drafts > 0  # vLLM's scheduler ran every step
    assert _runtime.current() is None


def test_unreadable_client_key_and_lone_client_certificate(tiny_model, env_provider, caplog,
                                                           tmp_path):
    cert = tmp_path / "client.pem"
    cert.write_text("not checked here")
    env_provider.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", str(cert))
    with caplog.at_level(logging.INFO, logger="otel_specdec"):
        run_steps(tiny_model, steps=1)
    [record] = plugin_records(caplog, logging.INFO)
    assert "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE" in record.getMessage()
    assert "CLIENT_KEY" in record.getMessage()
    SpecDecodeInstrumentor().uninstrument()
    SpecDecodeInstrumentor().instrument()
    caplog.clear()
    env_provider.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", str(tmp_path / "missing-key.pem"))
    with caplog.at_level(logging.INFO, logger="otel_specdec"):
        run_steps(tiny_model, steps=1)
    [record] = plugin_records(caplog, logging.INFO)
    assert "OTEL_EXPORTER_OTLP_CLIENT_KEY" in record.getMessage()
    assert "missing-key.pem" in record.getMessage()


@pytest.mark.parametrize("headers", [f"authorization=Bearer {SECRET},broken",
                                     f"=Bearer {SECRET}", f"x api key={SECRET}"])
def test_malformed_headers_are_named_but_never_printed(tiny_model, env_provider, caplog,
                                                       headers):
    env_provider.setenv("OTEL_EXPORTER_OTLP_METRICS_HEADERS", headers)
    with caplog.at_level(logging.DEBUG):
        run_steps(tiny_model, steps=1)
    [record] = plugin_records(caplog, logging.INFO)
    assert "OTEL_EXPORTER_OTLP_METRICS_HEADERS" in record.getMessage()
    assert SECRET not in caplog.text


def test_credentials_in_an_endpoint_are_not_printed(tiny_model, env_provider, caplog):
    env_provider.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://user:{SECRET}@collector:bad")
    with caplog.at_level(logging.DEBUG):
        run_steps(tiny_model, steps=1)
    [record] = plugin_records(caplog, logging.INFO)
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in record.getMessage()
    assert "***@collector:bad" in record.getMessage()
    assert SECRET not in caplog.text


@pytest.mark.parametrize(("variable", "value", "default"), [
    ("OTEL_METRIC_EXPORT_INTERVAL", "15s", "60000"),
    ("OTEL_METRIC_EXPORT_TIMEOUT", "-1", "30000"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "ten", "10"),
])
def test_bad_tuning_value_falls_back_and_still_exports(tiny_model, env_provider, caplog,
                                                       variable, value, default):
    with OtlpReceiver() as receiver, caplog.at_level(logging.INFO):
        env_provider.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint("grpc"))
        env_provider.setenv(variable, value)
        harness = run_steps(tiny_model)
        runtime = _runtime.current()
        assert runtime is not None
        runtime.flush()
        received = receiver.store.spec_decode_totals()
    [record] = plugin_records(caplog, logging.INFO)
    assert record.levelno == logging.ERROR
    assert f"{variable}={value!r}" in record.getMessage()
    assert f"using {default}" in record.getMessage()
    # The SDK's own vaguer warning about the same value is not emitted.
    assert not [r for r in caplog.records
                if r.name.startswith("opentelemetry") and "invalid value" in r.getMessage()]
    assert received["drafts"] == harness.vllm.drafts > 0


# --- The plugin's own failures -------------------------------------------------

def _summary(outputs: Any) -> list[Any]:
    """What vLLM hands back to the engine for one step, as plain values."""
    out = []
    for engine_index, engine_outputs in sorted(outputs.items()):
        stats = engine_outputs.scheduler_stats
        spec = stats.spec_decoding_stats if stats is not None else None
        out.append((
            engine_index,
            [(o.request_id, list(o.new_token_ids), o.finish_reason)
             for o in engine_outputs.outputs],
            dataclasses.astuple(spec) if spec is not None else None,
        ))
    return out


def _plan_run(model: str) -> list[Any]:
    harness = SchedulerHarness(build_scheduler(model, K))
    harness.add_requests(5, max_tokens=12)
    summaries = []
    for step in range(10):
        _, outputs = harness.step(lambda r, d, s=step: (s + int(r[4:])) % (K + 1),
                                  drafts_of_three)
        summaries.append(_summary(outputs))
    return summaries


def test_accounting_failure_is_logged_once_and_vllm_output_is_unchanged(
        tiny_model, reader, monkeypatch, caplog):
    calls = []

    def broken(self, *args):
        calls.append(1)
        raise RuntimeError("injected accounting failure")

    monkeypatch.setattr(StepAccountant, "observe_step", broken)
    with caplog.at_level(logging.WARNING):
        with_failure = _plan_run(tiny_model)
    SpecDecodeInstrumentor().uninstrument()
    without_plugin = _plan_run(tiny_model)
    SpecDecodeInstrumentor().instrument()  # the fixture uninstruments at teardown
    assert with_failure == without_plugin
    assert len(calls) == 1  # the plugin stopped after its first failure
    [record] = plugin_records(caplog)
    assert "update_from_output" in record.getMessage()
    assert "injected accounting failure" in caplog.text  # the traceback is kept


@pytest.mark.parametrize("target", ["counters", "histograms"])
def test_export_failure_is_logged_once_and_collection_goes_on(
        tiny_model, reader, monkeypatch, caplog, target):
    run_steps(tiny_model)
    assert total(reader.get_metrics_data(), "vllm.spec_decode.drafts") > 0

    def broken(*args, **kwargs):
        raise RuntimeError("injected export failure")

    if target == "counters":
        monkeypatch.setattr(SpecDecodeTotals, "snapshot", broken)
    else:
        from otel_specdec import _metrics_export

        monkeypatch.setattr(_metrics_export, "_length_point", broken)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            data = reader.get_metrics_data()
    [record] = plugin_records(caplog)
    assert "stops exporting" in record.getMessage()
    # The SDK did not see the failure (it would log per collection).
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert not points(data, "vllm.spec_decode.acceptance_length")


# --- Unsupported or changed vLLM -----------------------------------------------

def test_changed_scheduler_output_is_detected_by_the_real_check(
        tiny_model, reader, monkeypatch, caplog):
    from vllm.v1.core.sched import output

    SpecDecodeInstrumentor().uninstrument()
    fields = [(f.name, Any) for f in dataclasses.fields(output.SchedulerOutput)
              if f.name != "scheduled_spec_decode_tokens"]
    monkeypatch.setattr(output, "SchedulerOutput",
                        dataclasses.make_dataclass("SchedulerOutput", fields))
    with caplog.at_level(logging.WARNING):
        SpecDecodeInstrumentor().instrument()
    [record] = plugin_records(caplog)
    assert "SchedulerOutput.scheduled_spec_decode_tokens" in record.getMessage()
    assert not _patch.is_installed()
    monkeypatch.undo()
    run_steps(tiny_model, steps=2)  # vLLM runs normally, unpatched
    assert total(reader.get_metrics_data(), "vllm.spec_decode.drafts") == 0
    SpecDecodeInstrumentor().uninstrument()
    SpecDecodeInstrumentor().instrument()


def test_scheduler_without_update_method_is_not_patched(reader, monkeypatch, caplog):
    from vllm.v1.core.sched.scheduler import Scheduler

    SpecDecodeInstrumentor().uninstrument()
    monkeypatch.delattr(Scheduler, "update_from_output")
    scheduler_cls, reason = _vllm_compat.check_scheduler()
    assert scheduler_cls is None and "update_from_output" in reason
    with caplog.at_level(logging.WARNING):
        SpecDecodeInstrumentor().instrument()
    assert len(plugin_records(caplog)) == 1
    assert not _patch.is_installed()
    monkeypatch.undo()
    SpecDecodeInstrumentor().uninstrument()
    SpecDecodeInstrumentor().instrument()


# --- Fork ------------------------------------------------------------------------

def test_forked_child_reports_only_its_own_counts(tiny_model, reader):
    parent = run_steps(tiny_model)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            inherited = total(reader.get_metrics_data(), "vllm.spec_decode.drafts")
            own = run_steps(tiny_model, steps=3)
            data = reader.get_metrics_data()
            report = {"inherited": inherited, "own": own.vllm.drafts,
                      "exported": total(data, "vllm.spec_decode.drafts")}
        except BaseException as exc:  # report, do not raise in a forked pytest
            report = {"error": repr(exc)}
        os.write(write_fd, json.dumps(report).encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        report = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert "error" not in report, report
    assert report["inherited"] == 0  # none of the parent's totals
    assert report["exported"] == report["own"] > 0
    # The parent's totals are intact.
    assert total(reader.get_metrics_data(), "vllm.spec_decode.drafts") == parent.vllm.drafts


# --- Cardinality and content ------------------------------------------------------

def test_attributes_are_bounded_and_carry_no_request_data(tiny_model, reader):
    huge_name = "m" * 10_000
    harness = SchedulerHarness(build_scheduler(tiny_model, K, served_model_name=huge_name))
    request_ids = harness.add_requests(6)
    for _ in range(6):
        harness.step(accept_one, drafts_of_three)
    data = reader.get_metrics_data()
    seen = [p.attributes for p in points(data, "vllm.spec_decode.draft_tokens")]
    assert seen and total(data, "vllm.spec_decode.drafts") == harness.vllm.drafts
    allowed = {ATTR_MODEL, ATTR_METHOD, ATTR_NUM_SPEC_TOKENS, ATTR_POSITION}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    attrs = dict(point.attributes)
                    assert set(attrs) <= allowed, metric.name
                    assert attrs[ATTR_MODEL] == huge_name[:MAX_MODEL_NAME_LEN]
                    assert 0 <= attrs.get(ATTR_POSITION, 0) < K
                    assert not set(map(str, attrs.values())) & set(request_ids)
    assert {a[ATTR_POSITION] for a in seen} == set(range(K))
