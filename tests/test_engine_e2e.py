"""End to end: real vLLM (CPU build), engine core in its own process, the
plugin loaded through vLLM's entry point, OTLP export to a real receiver on
loopback. The totals received must equal vLLM's own counters exactly.

The export interval is left at its default (60 s), longer than each run, so
these tests also prove that the final values are flushed at shutdown.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from engine_child import run_in_child, shutdown_evidence, with_child_site
from fault_helpers import clean_env
from opentelemetry.sdk.resources import Resource

from otel_specdec.demo.receiver import OtlpReceiver

pytestmark = pytest.mark.engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def _clean_env(**extra: str) -> dict[str, str]:
    # The plugin's log timed: a failure shows how the engine stopped.
    return with_child_site(clean_env(**extra))


def run_engine(config: dict, env: dict[str, str], launcher: tuple[str, ...] = ()) -> dict:
    return run_in_child(config, env, launcher=launcher, timeout=420)


def received(store) -> dict:
    return store.spec_decode_totals()


def run_with_receiver(config: dict, protocol: str = "grpc", launcher: tuple[str, ...] = (),
                      **env: str) -> tuple[dict, object]:
    with OtlpReceiver() as receiver:
        result = run_engine(config, _clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint(protocol),
            OTEL_EXPORTER_OTLP_PROTOCOL=protocol, **env,
        ), launcher)
        return result, receiver.store


def assert_totals_equal_vllm(result: dict, store, own_provider: bool = True) -> None:
    vllm = result["vllm"]
    assert vllm["drafts"] > 0
    assert received(store) == vllm, shutdown_evidence(result, store)
    length = store.histogram_total("vllm.spec_decode.acceptance_length")
    assert length.count == vllm["drafts"]
    assert length.sum == vllm["drafts"] + vllm["accepted_tokens"]
    if not own_provider:
        return
    # Every series carries a per-process identity.
    for series in store.series("vllm.spec_decode.drafts"):
        assert series.resource["service.name"] == "vllm"
        assert series.resource["service.instance.id"]


def test_delta_temporality_totals_equal_vllm(tiny_model):
    """Delta export (for backends that want it), many intervals within the
    run: the deltas add up to vLLM's counters, histograms included."""
    result, store = run_with_receiver(
        {"model": tiny_model, "speculative_config": NGRAM}, "grpc",
        OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE="delta",
        OTEL_METRIC_EXPORT_INTERVAL="200")
    assert_totals_equal_vllm(result, store)
    assert store.requests > 2
    for name in ("vllm.spec_decode.drafts", "vllm.spec_decode.accepted_tokens",
                 "vllm.spec_decode.acceptance_length", "vllm.spec_decode.request.acceptance_rate"):
        assert store.series(name) and all(s.delta for s in store.series(name)), name


@pytest.fixture(scope="module")
def ngram_grpc(tiny_model):
    return run_with_receiver({"model": tiny_model, "speculative_config": NGRAM}, "grpc")


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_ngram_totals_equal_vllm(tiny_model, ngram_grpc, protocol):
    if protocol == "grpc":
        result, store = ngram_grpc
    else:
        result, store = run_with_receiver(
            {"model": tiny_model, "speculative_config": NGRAM}, protocol)
    assert_totals_equal_vllm(result, store)
    requests = store.histogram_total("vllm.spec_decode.request.acceptance_rate")
    assert 0 < requests.count <= len(result["token_ids"])


def test_identical_draft_model_accepts_everything(tiny_model):
    spec = {"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 3}
    result, store = run_with_receiver({"model": tiny_model, "speculative_config": spec})
    assert_totals_equal_vllm(result, store)
    totals = received(store)
    assert totals["accepted_tokens"] == totals["draft_tokens"]
    rates = store.histogram_total("vllm.spec_decode.request.acceptance_rate")
    assert rates.min == rates.max == 1.0


def test_different_draft_model(tiny_model, other_model):
    spec = {"method": "draft_model", "model": other_model, "num_speculative_tokens": 3}
    result, store = run_with_receiver(
        {"model": tiny_model, "speculative_config": spec}, "http/protobuf")
    assert_totals_equal_vllm(result, store)
    totals = received(store)
    assert totals["accepted_tokens"] < totals["draft_tokens"]
    [series] = store.series("vllm.spec_decode.drafts")
    assert series.attributes["vllm.spec_decode.method"] == "draft_model"


def test_greedy_output_identical_without_plugin(tiny_model, ngram_grpc):
    with_plugin, _ = ngram_grpc
    without = run_engine({"model": tiny_model, "speculative_config": NGRAM},
                         _clean_env(VLLM_PLUGINS=""))
    assert "otel_specdec" not in without["stderr"]
    assert without["token_ids"] == with_plugin["token_ids"]
    assert without["vllm"] == with_plugin["vllm"]


def test_both_activation_paths_do_not_double_count(tiny_model):
    """``opentelemetry-instrument`` (with the distro's SDK provider) and
    vLLM's general plugin both active in the same engine process."""
    launcher = (str(Path(sys.executable).with_name("opentelemetry-instrument")),)
    result, store = run_with_receiver(
        {"model": tiny_model, "speculative_config": NGRAM}, "grpc", launcher,
        OTEL_TRACES_EXPORTER="none", OTEL_LOGS_EXPORTER="none", OTEL_METRICS_EXPORTER="otlp",
        OTEL_METRIC_EXPORT_INTERVAL="1000",
    )
    assert_totals_equal_vllm(result, store, own_provider=False)
    # The metrics came through the distro's provider: its resource (its
    # default service name, not the plugin's), with a per-process identity
    # added because the distro's resource has none.
    [series] = store.series("vllm.spec_decode.drafts")
    # The SDK's own default (its spelling differs across SDK versions).
    with pytest.MonkeyPatch.context() as env:
        env.delenv("OTEL_SERVICE_NAME", raising=False)
        env.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
        sdk_default = Resource.create({}).attributes["service.name"]
    assert series.resource["service.name"] == sdk_default != "vllm"
    assert series.resource["telemetry.sdk.language"] == "python"
    assert series.resource["service.instance.id"]
    assert series.resource["vllm.data_parallel.rank"] == 0
