"""Request spans and exemplars on vLLM's real scheduler (driven by the
harness), exported through the SDK's in-memory span exporter and metric
reader: one span per finished request with drafts, in the trace its
``traceparent`` names, whose numbers are vLLM's own per-request counts and
add up to vLLM's counters; the per-request rate histogram links to them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from otel_helpers import histogram
from scheduler_harness import SchedulerHarness, build_scheduler

from otel_specdec import SpecDecodeInstrumentor, _instruments, _runtime
from otel_specdec._bounded import Deadline

K = 3
PARENT_SPAN = "00f067aa0ba902b7"


def trace_id(i: int) -> str:
    return f"{i + 1:032x}"


def traceparent(i: int) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id(i)}-{PARENT_SPAN}-01"}


def drafts_of_three(_req_id: str) -> list[int]:
    return [21, 22, 23]


def accept_varied(req_id: str, _drafts: list[int]) -> int:
    return (sum(map(ord, req_id)) + len(req_id)) % (K + 1)


class Traced:
    def __init__(self, spans: InMemorySpanExporter, reader: InMemoryMetricReader) -> None:
        self.spans = spans
        self.reader = reader

    def finished_spans(self) -> list[Any]:
        runtime = _runtime.current()
        assert runtime is not None and runtime.spans is not None
        runtime.spans.flush(Deadline(5))
        return [s for s in self.spans.get_finished_spans()
                if s.name == _instruments.SPAN_REQUEST]


@pytest.fixture
def traced(monkeypatch, request) -> Iterator[Traced]:
    sampler = getattr(request, "param", None)
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_SPECDEC_TRACES", "true")
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=sampler) if sampler else TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    instrumentor = SpecDecodeInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    instrumentor.instrument(meter_provider=meter_provider, tracer_provider=tracer_provider)
    yield Traced(exporter, reader)
    instrumentor.uninstrument()
    meter_provider.shutdown()
    tracer_provider.shutdown()


def run(harness: SchedulerHarness, n: int, steps: int, headers: Any = traceparent) -> list[str]:
    ids = harness.add_requests(n, max_tokens=14, trace_headers=headers)
    for _ in range(steps):
        harness.step(accept_varied, drafts_of_three)
    for req_id in ids:
        if req_id in harness.scheduler.requests:
            harness.abort(req_id)
    return ids


def test_one_span_per_request_in_its_trace_with_vllms_numbers(tiny_model, traced):
    harness = SchedulerHarness(build_scheduler(tiny_model, K, per_request_metrics=True))
    ids = run(harness, 5, steps=12)
    spans = traced.finished_spans()
    assert len(spans) == len(ids)
    by_trace = {f"{s.context.trace_id:032x}": s for s in spans}
    assert set(by_trace) == {trace_id(i) for i in range(len(ids))}
    vllm = harness.vllm
    totals = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    accepted_pos = [0] * K
    for i, req_id in enumerate(ids):
        span = by_trace[trace_id(i)]
        attrs = span.attributes
        assert f"{span.parent.span_id:016x}" == PARENT_SPAN and span.parent.is_remote
        # vLLM's own per-request counts for this request.
        drafted, accepted = harness.vllm_per_request[req_id]
        assert attrs[_instruments.SPAN_DRAFT_TOKENS] == drafted
        assert attrs[_instruments.SPAN_ACCEPTED_TOKENS] == accepted
        assert attrs[_instruments.SPAN_ACCEPTANCE_RATE] == accepted / drafted
        assert attrs[_instruments.SPAN_MEAN_ACCEPTANCE_LENGTH] == (
            1 + accepted / attrs[_instruments.SPAN_DRAFTS])
        assert sum(attrs[_instruments.SPAN_ACCEPTED_TOKENS_PER_POSITION]) == accepted
        assert sum(attrs[_instruments.SPAN_DRAFT_TOKENS_PER_POSITION]) == drafted
        assert attrs[_instruments.SPAN_FINISH_REASONS] in (("length",), ("abort",))
        assert attrs[_instruments.ATTR_NUM_SPEC_TOKENS] == K
        assert span.start_time < span.end_time
        totals["drafts"] += attrs[_instruments.SPAN_DRAFTS]
        totals["draft_tokens"] += drafted
        totals["accepted_tokens"] += accepted
        for pos, count in enumerate(attrs[_instruments.SPAN_ACCEPTED_TOKENS_PER_POSITION]):
            accepted_pos[pos] += count
        assert not any(req_id in str(v) for v in attrs.values())  # no request ids
    assert totals == {"drafts": vllm.drafts, "draft_tokens": vllm.draft_tokens,
                      "accepted_tokens": vllm.accepted_tokens}
    assert accepted_pos == vllm.accepted_per_pos


def test_rate_histogram_exemplars_point_at_request_spans(tiny_model, traced):
    harness = SchedulerHarness(build_scheduler(tiny_model, K))
    run(harness, 6, steps=12)
    spans = {(s.context.trace_id, s.context.span_id): s for s in traced.finished_spans()}
    point = histogram(traced.reader.get_metrics_data(), _instruments.REQUEST_ACCEPTANCE_RATE)
    assert point is not None and point.exemplars
    bounds = _instruments.REQUEST_RATE_BOUNDS
    for exemplar in point.exemplars:
        span = spans[(exemplar.trace_id, exemplar.span_id)]
        assert exemplar.value == span.attributes[_instruments.SPAN_ACCEPTANCE_RATE]
    # One exemplar per bucket that holds a request, none for empty buckets.
    filled = [i for i, count in enumerate(point.bucket_counts) if count]
    linked = {next(i for i, b in enumerate(bounds) if e.value <= b) for e in point.exemplars}
    assert linked == set(filled)


@pytest.mark.parametrize("traced", [ParentBased(ALWAYS_OFF)], indirect=True)
def test_requests_without_context_follow_the_sampler(tiny_model, traced):
    """Parent-based, root always off: requests with a sampled traceparent get
    a span, requests without one do not (and link no exemplar)."""
    harness = SchedulerHarness(build_scheduler(tiny_model, K))
    run(harness, 4, steps=12, headers=lambda i: traceparent(i) if i % 2 == 0 else None)
    spans = traced.finished_spans()
    assert {f"{s.context.trace_id:032x}" for s in spans} == {trace_id(0), trace_id(2)}
    point = histogram(traced.reader.get_metrics_data(), _instruments.REQUEST_ACCEPTANCE_RATE)
    assert {e.trace_id for e in point.exemplars} <= {s.context.trace_id for s in spans}


def test_no_span_and_the_vectorised_path_without_the_switch(tiny_model, reader):
    harness = SchedulerHarness(build_scheduler(tiny_model, K))
    accountant = harness.scheduler.__dict__["_otel_specdec_accountant"][1]
    assert accountant.vectorise_from < 10**6
    run(harness, 3, steps=6)
    runtime = _runtime.current()
    assert runtime is not None and runtime.spans is None
    point = histogram(reader.get_metrics_data(), _instruments.REQUEST_ACCEPTANCE_RATE)
    assert point is not None and point.count == 3 and not point.exemplars


def test_held_state_stays_bounded_with_spans_on(tiny_model, traced):
    """With spans on every step takes the exact path: the ids of released
    requests must still be forgotten after a few steps (they were pruned only
    in the C step, so they grew with every request served)."""
    harness = SchedulerHarness(build_scheduler(tiny_model, K))
    accountant = harness.scheduler.__dict__["_otel_specdec_accountant"][1]
    batch, held = 16, []
    for _wave in range(3):
        for _ in range(10):  # 10 rounds of `batch` requests, each run to its end
            harness.add_requests(batch, max_tokens=8, trace_headers=traceparent)
            while harness.scheduler.requests:
                harness.step(accept_varied, drafts_of_three)
        held.append(accountant.held_state())
    assert accountant.steps_by_path()["native"] == 0  # spans on: the exact path
    # Ids are kept for keep_steps and pruned every few steps: at most the
    # requests released in that many steps (a batch per step, at most).
    from otel_specdec import _accounting

    window = accountant._freed_keep_steps + _accounting._PRUNE_FREED_EVERY_STEPS
    assert all(h["released_ids"] <= window * batch for h in held), held
    assert held[-1]["released_ids"] <= held[0]["released_ids"] + batch, held
    assert all(h["span_details"] == 0 and h["tallies_spilled"] <= batch for h in held), held
    assert len(traced.finished_spans()) == 3 * 10 * batch
