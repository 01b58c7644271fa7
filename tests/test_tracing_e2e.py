"""Request spans end to end: real vLLM (CPU build, tiny model, ngram), the
plugin loaded through vLLM's entry point in the engine process, spans and
metrics exported over OTLP to a real receiver on loopback.

* offline: ``LLMEngine.add_request(trace_headers=...)`` (engine core in its
  own process): one span per request in the trace its ``traceparent``
  names, adding up to vLLM's counters; the rate histogram's exemplars point
  at those spans; without the switch, no span at all;
* the OpenAI server with vLLM's own tracing on: a client's ``traceparent``
  puts the plugin's span in the same trace as vLLM's ``llm_request`` span.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_child import assert_delivered, run_in_child, shutdown_evidence, with_child_site
from fault_helpers import ApiServer, clean_env, prometheus_counters

from otel_specdec import _instruments as names
from otel_specdec.demo.engine_run import DEFAULT_PROMPTS
from otel_specdec.demo.receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
PARENT_SPAN = "00f067aa0ba902b7"


def trace_id(i: int) -> str:
    return f"{0xA0 + i:032x}"


def traceparent(i: int) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id(i)}-{PARENT_SPAN}-01"}


def span_totals(spans: list[ReceivedSpan]) -> dict:
    per_pos = [0, 0, 0]
    for span in spans:
        for pos, count in enumerate(span.attributes[names.SPAN_ACCEPTED_TOKENS_PER_POSITION]):
            per_pos[pos] += count
    return {
        "drafts": sum(s.attributes[names.SPAN_DRAFTS] for s in spans),
        "draft_tokens": sum(s.attributes[names.SPAN_DRAFT_TOKENS] for s in spans),
        "accepted_tokens": sum(s.attributes[names.SPAN_ACCEPTED_TOKENS] for s in spans),
        "accepted_per_pos": per_pos,
    }


def run_traced(tiny_model: str, receiver: OtlpReceiver, **env: str) -> dict:
    headers = [traceparent(i) for i in range(len(DEFAULT_PROMPTS))]
    return run_in_child(
        {"model": tiny_model, "speculative_config": NGRAM, "trace_headers": headers},
        with_child_site(clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint("grpc"), **env)),
        timeout=420)


def test_offline_request_spans_in_their_traces_sum_to_vllm(tiny_model):
    with OtlpReceiver() as receiver:
        result = run_traced(tiny_model, receiver, OTEL_SPECDEC_TRACES="true")
        spans = receiver.spans.spans(names.SPAN_REQUEST)
        store = receiver.store
    vllm = result["vllm"]
    assert vllm["drafts"] > 0
    # Every request that drafted has exactly one span, in its own trace,
    # under the client's span; together they are vLLM's counters.
    assert spans and len({s.trace_id for s in spans}) == len(spans)
    assert {s.trace_id for s in spans} <= {trace_id(i) for i in range(len(DEFAULT_PROMPTS))}
    assert all(s.parent_span_id == PARENT_SPAN for s in spans)
    assert span_totals(spans) == vllm
    for span in spans:
        attrs = span.attributes
        assert attrs[names.SPAN_ACCEPTANCE_RATE] == (
            attrs[names.SPAN_ACCEPTED_TOKENS] / attrs[names.SPAN_DRAFT_TOKENS])
        assert attrs[names.SPAN_FINISH_REASONS] == ("length",)
        assert attrs[names.ATTR_METHOD] == "ngram"
        assert span.start_ns < span.end_ns
    # The spans and the metrics come from the same process identity.
    series = store.series(names.DRAFTS)
    assert len(series) == 1, shutdown_evidence(result, store)
    [metric_series] = series
    assert {s.resource["service.instance.id"] for s in spans} == {
        metric_series.resource["service.instance.id"]}
    # Exemplars of the rate histogram open those spans.
    rate = store.histogram_total(names.REQUEST_ACCEPTANCE_RATE)
    by_ids = {(s.trace_id, s.span_id): s for s in spans}
    assert rate.exemplars
    for value, exemplar_trace, exemplar_span in rate.exemplars:
        assert by_ids[(exemplar_trace, exemplar_span)].attributes[
            names.SPAN_ACCEPTANCE_RATE] == value


def test_no_span_without_the_switch(tiny_model):
    with OtlpReceiver() as receiver:
        result = run_traced(tiny_model, receiver)
        assert result["vllm"]["drafts"] > 0
        assert_delivered(receiver.store, result)
        assert receiver.spans.spans() == []
        assert not receiver.store.histogram_total(names.REQUEST_ACCEPTANCE_RATE).exemplars


def test_api_server_span_joins_the_clients_trace(tiny_model):
    prompts = ["one two three one two three one two", "the lazy dog the lazy dog",
               "a b c a b c a b c"]
    with OtlpReceiver() as receiver:
        endpoint = receiver.endpoint("grpc")
        server = ApiServer(
            tiny_model, NGRAM,
            clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_SPECDEC_TRACES="true"),
            "--otlp-traces-endpoint", endpoint)
        try:
            server.wait_healthy()
            with ThreadPoolExecutor(len(prompts)) as pool:
                list(pool.map(lambda i: server.complete(prompts[i], headers=traceparent(i)),
                              range(len(prompts))))
            vllm = prometheus_counters(server.metrics_text())
            server.terminate()
        finally:
            server.kill()
        ours = receiver.spans.spans(names.SPAN_REQUEST)
        theirs = [s for s in receiver.spans.spans() if s.name != names.SPAN_REQUEST]
    assert vllm["drafts"] > 0
    assert span_totals(ours) == vllm
    client_traces = {trace_id(i) for i in range(len(prompts))}
    assert {s.trace_id for s in ours} == client_traces
    assert all(s.parent_span_id == PARENT_SPAN for s in ours)
    # vLLM's own request span lands in the same traces.
    assert {s.trace_id for s in theirs} >= client_traces
