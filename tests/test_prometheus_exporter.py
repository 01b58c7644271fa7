"""``OTEL_METRICS_EXPORTER=prometheus`` on vLLM's real scheduler (driven by
the harness): the engine process serves /metrics with exactly vLLM's
counts, in the Prometheus names the dashboard and rules use; a taken or bad
port is one error line and the scheduler runs on. Also: cumulative
histograms exist, at zero, from the engine's start (so that rate() sees the
first increase), delta ones only once they have data."""

from __future__ import annotations

import logging
import socket
import urllib.request

import pytest
from fault_helpers import free_port
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from otel_helpers import histogram
from prometheus_client.parser import text_string_to_metric_families
from scheduler_harness import SchedulerHarness, build_scheduler

from otel_specdec import SpecDecodeInstrumentor, _runtime
from otel_specdec._instruments import ACCEPTANCE_LENGTH, REQUEST_ACCEPTANCE_RATE

K = 3


def drafts_of_three(_req_id: str) -> list[int]:
    return [21, 22, 23]


def accept_by_request(req_id: str, _drafts: list[int]) -> int:
    # Full, partial and zero acceptance across requests.
    return sum(map(ord, req_id)) % (K + 1)


def scrape(port: int) -> dict[str, float]:
    """Every sample of the page, keyed ``name{sorted labels}``, plus label sets."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if not k.startswith("otel_scope") and k not in (
                                  "gen_ai_request_model", "vllm_spec_decode_method",
                                  "vllm_spec_decode_num_speculative_tokens"))
            samples[f"{sample.name}{{{labels}}}"] = samples.get(
                f"{sample.name}{{{labels}}}", 0.0) + sample.value
    return samples


def test_prometheus_exporter_serves_vllms_counts(tiny_model, env_provider):
    port = free_port()
    env_provider.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    env_provider.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    env_provider.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
    harness = SchedulerHarness(build_scheduler(tiny_model, K))
    at_start = scrape(port)
    # Counters and histograms exist at zero before the first step.
    assert at_start["vllm_spec_decode_drafts_total{}"] == 0
    assert at_start["vllm_spec_decode_acceptance_length_count{}"] == 0
    assert at_start["vllm_spec_decode_request_acceptance_rate_count{}"] == 0
    ids = harness.add_requests(6)
    for _ in range(8):
        harness.step(accept_by_request, drafts_of_three)
    for req_id in ids:
        harness.abort(req_id)
    vllm = harness.vllm
    samples = scrape(port)
    assert vllm.drafts > 0 and 0 < vllm.accepted_tokens < vllm.draft_tokens
    assert samples["vllm_spec_decode_drafts_total{}"] == vllm.drafts
    assert sum(samples[f"vllm_spec_decode_draft_tokens_total{{vllm_spec_decode_position={i}}}"]
               for i in range(K)) == vllm.draft_tokens
    assert [samples[f"vllm_spec_decode_accepted_tokens_total{{vllm_spec_decode_position={i}}}"]
            for i in range(K)] == vllm.accepted_per_pos
    # Mean acceptance length from the histogram is vLLM's 1 + accepted / drafts.
    assert samples["vllm_spec_decode_acceptance_length_count{}"] == vllm.drafts
    assert samples["vllm_spec_decode_acceptance_length_sum{}"] == vllm.drafts + vllm.accepted_tokens
    assert samples["vllm_spec_decode_request_acceptance_rate_count{}"] == 6
    # Only the plugin's metrics (and target_info): not the process's other
    # prometheus_client metrics, which belong to whoever registered them.
    assert not [name for name in samples if name.startswith(("python_", "process_"))]
    runtime = _runtime.current()
    assert runtime is not None
    SpecDecodeInstrumentor().uninstrument()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_prometheus_port_taken_is_one_line_and_the_scheduler_runs_on(
        tiny_model, env_provider, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env_provider.setenv("OTEL_METRICS_EXPORTER", "prometheus")
        env_provider.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
        env_provider.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
        with caplog.at_level(logging.INFO, logger="otel_specdec"):
            harness = SchedulerHarness(build_scheduler(tiny_model, K))
            harness.add_requests(2)
            for _ in range(3):
                harness.step(accept_by_request, drafts_of_three)
    records = [r for r in caplog.records if r.name.startswith("otel_specdec")]
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    message = records[0].getMessage()
    assert f"OTEL_EXPORTER_PROMETHEUS_PORT={port}" in message and "disabled" in message
    assert harness.vllm.drafts > 0
    assert _runtime.current() is None


@pytest.mark.parametrize("value", ["94x4", "70000", "0"])
def test_bad_prometheus_port_value(tiny_model, env_provider, caplog, value):
    env_provider.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    env_provider.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", value)
    with caplog.at_level(logging.INFO, logger="otel_specdec"):
        SchedulerHarness(build_scheduler(tiny_model, K))
    [record] = [r for r in caplog.records if r.name.startswith("otel_specdec")]
    assert f"OTEL_EXPORTER_PROMETHEUS_PORT='{value}'" in record.getMessage()
    assert _runtime.current() is None


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_histograms_from_the_start_only_when_cumulative(tiny_model, temporality):
    delta = temporality == "delta"
    reader = InMemoryMetricReader(preferred_temporality={
        Histogram: AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE})
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    instrumentor = SpecDecodeInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    instrumentor.instrument(meter_provider=provider)
    try:
        harness = SchedulerHarness(build_scheduler(tiny_model, K))
        before = reader.get_metrics_data()
        for name in (ACCEPTANCE_LENGTH, REQUEST_ACCEPTANCE_RATE):
            point = histogram(before, name)
            if delta:
                assert point is None
            else:
                assert point is not None and point.count == 0 and point.sum == 0
                assert sum(point.bucket_counts) == 0
        ids = harness.add_requests(3)
        for _ in range(4):
            harness.step(accept_by_request, drafts_of_three)
        for req_id in ids:
            harness.abort(req_id)
        after = reader.get_metrics_data()
        assert histogram(after, ACCEPTANCE_LENGTH).count == harness.vllm.drafts
        assert histogram(after, REQUEST_ACCEPTANCE_RATE).count == 3
        if delta:
            # Nothing happened since: no empty delta points.
            assert histogram(reader.get_metrics_data(), ACCEPTANCE_LENGTH) is None
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
