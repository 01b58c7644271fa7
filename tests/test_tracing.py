"""Request spans and exemplars on vLLM's real scheduler (driven by the
harness), exported through the SDK's in-memory span exporter and metric
reader: one span per finished request with drafts, in the trace its
``traceparent`` names, whose numbers are vLLM's own per-request counts and
add up to vLLM's counters; the per-request rate histogram links to them."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    TraceIdRatioBased,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from otel_helpers import histogram
from scheduler_harness import SchedulerHarness, build_scheduler

from otel_specdec import SpecDecodeInstrumentor, _accounting, _instruments, _runtime, _tracing
from otel_specdec._bounded import Deadline
from otel_specdec._request_details import DetailHandover
from otel_specdec._span_sampling import SamplingPlan, plan_for

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


@pytest.fixture(params=["native", "mixed", "exact"])
def span_path(request, monkeypatch) -> Iterator[str]:
    """Each span test through every place request detail is kept.

    "native": the C pass keeps it in its rows; "mixed": the C pass declines
    every other step, so the exact path adds those steps' detail to the C
    pass's store and a request's detail is summed from both; "exact": no C
    pass (``RequestDetails``). Afterwards, the paths that should have taken
    steps did.
    """
    if request.param == "exact":
        monkeypatch.setattr(_accounting, "NATIVE_SCANNER", None)
    else:
        assert _accounting.NATIVE_SCANNER is not None, "the C accelerator was not built"
    accountants: list = []
    original_init = _accounting.StepAccountant.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        accountants.append(self)
        if request.param == "mixed" and self.step_fast is not None:
            fast, calls = self.step_fast, itertools.count()
            self.step_fast = lambda *a: fast(*a) if next(calls) % 2 else None

    monkeypatch.setattr(_accounting.StepAccountant, "__init__", recording_init)
    yield request.param
    steps = {path: sum(a.steps_by_path()[path] for a in accountants)
             for path in ("exact", "native")}
    assert (steps["native"] > 0) == (request.param != "exact"), steps
    assert (steps["exact"] > 0) == (request.param != "native"), steps


@pytest.fixture
def traced(monkeypatch, request, span_path) -> Iterator[Traced]:
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


def test_no_span_without_the_switch(tiny_model, reader):
    harness = SchedulerHarness(build_scheduler(tiny_model, K))
    run(harness, 3, steps=6)
    runtime = _runtime.current()
    assert runtime is not None and runtime.spans is None
    point = histogram(reader.get_metrics_data(), _instruments.REQUEST_ACCEPTANCE_RATE)
    assert point is not None and point.count == 3 and not point.exemplars


def test_held_state_stays_bounded_with_spans_on(tiny_model, traced):
    """With spans on, released ids are forgotten after a few steps on every
    path (they were once pruned only in the C step, so with spans on they
    grew with every request served), and request detail is held for live
    requests only."""
    harness = SchedulerHarness(build_scheduler(tiny_model, K))
    accountant = harness.scheduler.__dict__["_otel_specdec_accountant"][1]
    batch, held, live_detail = 16, [], 0
    for _wave in range(3):
        for _ in range(10):  # 10 rounds of `batch` requests, each run to its end
            harness.add_requests(batch, max_tokens=8, trace_headers=traceparent)
            while harness.scheduler.requests:
                harness.step(accept_varied, drafts_of_three)
                live_detail = max(live_detail, accountant.held_state()["span_details"])
        held.append(accountant.held_state())
    # Ids are kept for keep_steps and pruned every few steps: at most the
    # requests released in that many steps (a batch per step, at most).
    window = accountant._freed_keep_steps + _accounting._PRUNE_FREED_EVERY_STEPS
    assert all(h["released_ids"] <= window * batch for h in held), held
    assert held[-1]["released_ids"] <= held[0]["released_ids"] + batch, held
    assert all(h["span_details"] == 0 and h["tallies_spilled"] <= batch for h in held), held
    assert 0 < live_detail <= batch  # detail was kept, for the live requests only
    assert len(traced.finished_spans()) == 3 * 10 * batch


def sampled_or_not(i: int) -> dict[str, str]:
    """Even requests: a sampled parent; odd: an unsampled one."""
    return {"traceparent": f"00-{trace_id(i)}-{PARENT_SPAN}-{'01' if i % 2 == 0 else '00'}"}


@pytest.mark.parametrize("traced", [None], indirect=True)
def test_unsampled_parents_keep_no_detail(tiny_model, traced):
    """The default sampler (parent-based): requests whose parent is not
    sampled get no span and keep no detail while they run, also after they
    move rows (the first three finish early and the batch is condensed);
    the others do, with vLLM's numbers, summed over their rows."""
    harness = SchedulerHarness(build_scheduler(tiny_model, K, per_request_metrics=True))
    accountant = harness.scheduler.__dict__["_otel_specdec_accountant"][1]
    ids = harness.add_requests(3, max_tokens=6, trace_headers=sampled_or_not)
    ids += harness.add_requests(3, max_tokens=14, trace_headers=lambda i: sampled_or_not(i + 3))
    most, moved_unsampled = 0, False
    while harness.scheduler.requests:  # every request to its end
        harness.step(accept_varied, drafts_of_three)
        most = max(most, accountant.held_state()["span_details"])
        if accountant._scanner is not None:
            moved_unsampled |= None in accountant._scanner.detail_spilled.values()
    assert most == 3  # the three sampled requests, all live at once
    spans = traced.finished_spans()
    assert sorted(f"{s.context.trace_id:032x}" for s in spans) == [trace_id(i) for i in (0, 2, 4)]
    for span in spans:
        i = int(f"{span.context.trace_id:032x}", 16) - 1
        drafted, accepted = harness.vllm_per_request[ids[i]]
        assert span.attributes[_instruments.SPAN_DRAFT_TOKENS] == drafted
        assert span.attributes[_instruments.SPAN_ACCEPTED_TOKENS] == accepted
    if accountant._scanner is not None and accountant.steps_by_path()["exact"] == 0:
        assert moved_unsampled  # a request that moved rows kept its decision, not detail


class CountingHeaders(Mapping):
    """Trace headers that count the plugin's reads of them."""

    def __init__(self, headers: dict[str, str]) -> None:
        self._headers = headers
        self.reads = 0

    def __getitem__(self, key: str) -> str:
        self.reads += 1
        return self._headers[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._headers)

    def __len__(self) -> int:
        return len(self._headers)


@pytest.mark.parametrize("span_path", ["native"], indirect=True)
def test_the_c_pass_reads_trace_context_once_when_the_request_is_scheduled(
        tiny_model, traced):
    """The C pass decides a request's detail in the step that first
    schedules it (vLLM has just touched the request and its headers; at
    its first verified draft, a step or more later, they are cold), and
    never reads them again, also after the request moves rows. (The exact
    path decides at the first verified draft.)"""
    harness = SchedulerHarness(build_scheduler(tiny_model, K, per_request_metrics=True))
    headers = [CountingHeaders(sampled_or_not(i)) for i in range(6)]
    harness.add_requests(3, max_tokens=6, trace_headers=lambda i: headers[i])
    harness.add_requests(3, max_tokens=14, trace_headers=lambda i: headers[i + 3])
    harness.step(accept_varied, drafts_of_three)  # the prefill: no draft verified yet
    assert [h.reads for h in headers] == [1] * 6
    while harness.scheduler.requests:  # the first three finish early: rows move
        harness.step(accept_varied, drafts_of_three)
    assert [h.reads for h in headers] == [1] * 6
    assert len(traced.finished_spans()) == 3


@pytest.mark.parametrize("traced", [ALWAYS_OFF, ParentBased(ALWAYS_OFF, ALWAYS_OFF)],
                         indirect=True)
def test_a_sampler_that_samples_nothing_costs_what_spans_off_cost(tiny_model, traced):
    """No span can be sampled: the accounting keeps no detail at all (it is
    built as with spans off) and the metrics are still vLLM's."""
    harness = SchedulerHarness(build_scheduler(tiny_model, K))
    accountant = harness.scheduler.__dict__["_otel_specdec_accountant"][1]
    assert accountant._add_detail is None and accountant._details is None
    run(harness, 4, steps=12, headers=sampled_or_not)
    assert traced.finished_spans() == []
    point = histogram(traced.reader.get_metrics_data(), _instruments.REQUEST_ACCEPTANCE_RATE)
    assert point is not None and point.count == 4 and not point.exemplars
    vllm = harness.vllm
    assert sum(accountant.totals.accepted_hist) == vllm.drafts


HEADER_CASES: list[Any] = [
    None, {}, {"tracestate": "x=1"},
    {"traceparent": f"00-{trace_id(3)}-{PARENT_SPAN}-01"},
    {"traceparent": f"00-{trace_id(3)}-{PARENT_SPAN}-00"},
    {"traceparent": f"00-{trace_id(3)}-{PARENT_SPAN}-03"},
    {"traceparent": f"00-{trace_id(3)}-{PARENT_SPAN}-02"},
    {"traceparent": f"  00-{trace_id(3)}-{PARENT_SPAN}-01 "},
    {"traceparent": f"01-{trace_id(3)}-{PARENT_SPAN}-01-extra"},
    {"traceparent": f"00-{trace_id(3)}-{PARENT_SPAN}-01-extra"},
    {"traceparent": f"ff-{trace_id(3)}-{PARENT_SPAN}-01"},
    {"traceparent": f"00-{'0' * 32}-{PARENT_SPAN}-01"},
    {"traceparent": f"00-{trace_id(3)}-{'0' * 16}-01"},
    {"traceparent": f"00-{trace_id(3).upper()}-{PARENT_SPAN}-01"},
    {"traceparent": f"00-{trace_id(3)}-{PARENT_SPAN}-1"},
    {"traceparent": f"00-{trace_id(3)}{PARENT_SPAN}-01"},
    {"traceparent": ""}, {"traceparent": "garbage"},
]


HEADER_CASES += [
    {"traceparent": [f"00-{trace_id(3)}-{PARENT_SPAN}-01", "garbage"]},  # multi-valued
    {"traceparent": ("garbage", f"00-{trace_id(3)}-{PARENT_SPAN}-01")},
    {"traceparent": []},
    {"traceparent": f"00-{trace_id(3)}-{PARENT_SPAN}-01\n"},
    {"traceparent": f"00-{trace_id(3)}-{PARENT_SPAN}-01\t"},
    {"traceparent": f"cc-{trace_id(3)}-{PARENT_SPAN}-01-{'x' * 500}"},  # over 512 characters
    {"traceparent": f"cc-{trace_id(3)}-{PARENT_SPAN}-00-{'x' * 400}"},
]

_PROPAGATOR = TraceContextTextMapPropagator()


def sdk_keeps(plan: SamplingPlan, trace_headers: Mapping[str, Any] | None) -> bool:
    """The reference: the plan applied to the parent the SDK's own
    propagator extracts, as the span is built."""
    if trace_headers:
        context = trace.get_current_span(_PROPAGATOR.extract(trace_headers)).get_span_context()
        if context.is_valid:
            return plan.sampled_parent if context.trace_flags.sampled else plan.unsampled_parent
    return plan.root


def expected_keeps(plan: SamplingPlan, trace_headers: Mapping[str, Any] | None) -> bool:
    """What the plan must answer: the reference's answer, except for a
    ``traceparent`` over 512 characters, which SDK versions read differently
    (1.28 reads it, 1.45 ignores it): that request's detail is kept and the
    sampler decides with the span."""
    value = trace_headers.get("traceparent") if trace_headers else None
    if isinstance(value, str) and len(value) > 512:
        return True
    return sdk_keeps(plan, trace_headers)


MIXED_PLANS = [SamplingPlan(True, True, False), SamplingPlan(False, True, False),
               SamplingPlan(False, False, True), SamplingPlan(True, False, True)]


@pytest.mark.parametrize("plan", MIXED_PLANS)
def test_the_plan_reads_trace_context_as_the_sdks_propagator_does(plan):
    """``SamplingPlan.keeps`` checks ``traceparent`` itself (the SDK's
    propagator builds a context per call): it answers as the propagator
    does for valid, sampled, unsampled, malformed and multi-valued values.
    Values over 512 characters, which older SDKs (1.28) read and recent ones
    ignore, keep their detail (the sampler decides with the span)."""
    for headers in HEADER_CASES:
        assert plan.keeps(headers) == expected_keeps(plan, headers), headers


@settings(max_examples=200, derandomize=True, deadline=None)
@given(version=st.sampled_from(["00", "01", "cc", "ff", "0", "0g", "AB"]),
       trace=st.sampled_from([trace_id(3), "0" * 32, trace_id(3).upper(), trace_id(3)[:31]]),
       span=st.sampled_from([PARENT_SPAN, "0" * 16, PARENT_SPAN + "0"]),
       flags=st.sampled_from(["00", "01", "02", "03", "ff", "1", "0x"]),
       tail=st.text(alphabet=" \t\n-x0", max_size=4),
       lead=st.text(alphabet=" \t", max_size=2))
def test_the_plan_and_the_propagator_agree_on_generated_values(version, trace, span, flags,
                                                              tail, lead):
    headers = {"traceparent": f"{lead}{version}-{trace}-{span}-{flags}{tail}"}
    for plan in MIXED_PLANS:
        assert plan.keeps(headers) == sdk_keeps(plan, headers), headers


TOGETHER_SAMPLERS = [ParentBased(ALWAYS_ON), ParentBased(ALWAYS_OFF),
                     ParentBased(ALWAYS_OFF, remote_parent_not_sampled=ALWAYS_ON), ALWAYS_ON]


@pytest.mark.parametrize("span_path", ["native"], indirect=True)
@pytest.mark.parametrize("traced", TOGETHER_SAMPLERS, indirect=True)
def test_requests_scheduled_together_are_decided_as_the_sdk_decides(tiny_model, traced,
                                                                   request):
    """The requests that one step schedules are decided together, at the end
    of the C pass: for every kind of trace context, a non-dict mapping among
    them, the answer of the reference (the SDK's propagator), and the spans
    follow."""
    cases: list[Any] = [*HEADER_CASES,
                        CountingHeaders({"traceparent": f"00-{trace_id(4)}-{PARENT_SPAN}-01"}),
                        CountingHeaders({"traceparent": f"00-{trace_id(5)}-{PARENT_SPAN}-00"})]
    plan = plan_for(request.node.callspec.params["traced"])
    harness = SchedulerHarness(build_scheduler(tiny_model, K, per_request_metrics=True))
    ids = harness.add_requests(len(cases), max_tokens=6, trace_headers=lambda i: cases[i])
    harness.step(accept_varied, drafts_of_three)  # the prefill: every request decided
    scanner = harness.scheduler.__dict__["_otel_specdec_accountant"][1]._scanner
    expected = {req_id for req_id, headers in zip(ids, cases, strict=True)
                if expected_keeps(plan, headers)}
    assert 0 < len(expected) <= len(cases)
    assert set(scanner.detail_owners) == expected
    while harness.scheduler.requests:
        harness.step(accept_varied, drafts_of_three)
    # The spans are the sampler's: a request kept for an over-long value
    # may get none.
    assert len(traced.finished_spans()) == sum(
        1 for req_id, headers in zip(ids, cases, strict=True) if sdk_keeps(plan, headers))


@pytest.mark.parametrize("span_path", ["native"], indirect=True)
@pytest.mark.parametrize("traced", [ParentBased(ALWAYS_ON), ALWAYS_ON], indirect=True)
def test_the_c_pass_leaves_each_decision_and_the_hand_over_to_python(
        tiny_model, traced, request, monkeypatch):
    """The C pass parses no trace context and keeps no hand-over list: it
    asks ``DetailHandover.decide`` once per step, about the requests that
    step first schedules (not at all where the plan keeps every request),
    and passes finished requests' detail to ``DetailHandover.hand_over``
    once per call."""
    decided: list[list[Any]] = []
    handed: list[int] = []
    decide, hand_over = DetailHandover.decide, DetailHandover.hand_over

    def recording_decide(self, requests):
        decided.append(list(requests))
        return decide(self, requests)

    def recording_hand_over(self, released):
        handed.append(len(released))
        return hand_over(self, released)

    monkeypatch.setattr(DetailHandover, "decide", recording_decide)
    monkeypatch.setattr(DetailHandover, "hand_over", recording_hand_over)
    harness = SchedulerHarness(build_scheduler(tiny_model, K, per_request_metrics=True))
    ids = harness.add_requests(6, max_tokens=6, trace_headers=lambda i: traceparent(i))
    harness.step(accept_varied, drafts_of_three)
    keeps_all = plan_for(request.node.callspec.params["traced"]).keeps_all()
    if keeps_all:
        assert decided == []
    else:
        assert len(decided) == 1
        assert sorted(r.request_id for r in decided[0]) == sorted(ids)
    steps = 1
    while harness.scheduler.requests:
        harness.step(accept_varied, drafts_of_three)
        steps += 1
    assert len(decided) == (0 if keeps_all else 1)  # no request decided twice
    assert 0 < len(handed) <= steps and sum(handed) == len(ids)
    assert len(traced.finished_spans()) == len(ids)


def test_the_plan_follows_the_sampler():
    assert plan_for(ALWAYS_OFF).keeps_none()
    assert plan_for(ALWAYS_ON) == SamplingPlan(True, True, True)
    assert plan_for(ParentBased(ALWAYS_OFF)) == SamplingPlan(False, True, False)
    assert plan_for(ParentBased(ALWAYS_ON)) == SamplingPlan(True, True, False)
    assert plan_for(ParentBased(TraceIdRatioBased(0.1))) == SamplingPlan(True, True, False)
    assert plan_for(TraceIdRatioBased(0.0)).keeps_none()
    assert plan_for(TraceIdRatioBased(0.5)) == SamplingPlan(True, True, True)
    assert plan_for(object()) == SamplingPlan(True, True, True)  # unknown: decided later


def test_a_stuck_span_worker_drops_spans_once_and_the_metrics_stay_exact(
        tiny_model, traced, monkeypatch, caplog):
    """The hand-over is bounded: with the worker not taking anything, details
    beyond the limit are dropped, one warning says so, and the metrics are
    vLLM's own; what was kept becomes spans when the worker runs again."""
    monkeypatch.setattr(_tracing, "MAX_PENDING", 3)
    taken = DetailHandover.take
    monkeypatch.setattr(DetailHandover, "take", lambda self: [])  # the worker takes nothing
    harness = SchedulerHarness(build_scheduler(tiny_model, K, per_request_metrics=True))
    runtime = _runtime.current()
    assert runtime is not None and runtime.spans is not None
    handover = runtime.spans.handover
    assert handover.limit == 3
    with caplog.at_level(logging.WARNING, logger="otel_specdec"):
        ids = run(harness, 8, steps=12)
        assert len(handover.items) == 3
    drops = [r for r in caplog.records if "wait for their span" in r.getMessage()]
    assert len(drops) == 1
    point = histogram(traced.reader.get_metrics_data(), _instruments.REQUEST_ACCEPTANCE_RATE)
    assert point is not None and point.count == len(ids)
    assert sum(harness.scheduler.__dict__["_otel_specdec_accountant"][1]
               .totals.accepted_hist) == harness.vllm.drafts
    monkeypatch.setattr(DetailHandover, "take", taken)
    assert len(traced.finished_spans()) == 3


@pytest.mark.parametrize("span_path", ["native"], indirect=True)
def test_the_span_worker_polls_less_while_nothing_is_handed_over(
        tiny_model, monkeypatch, span_path, traced):
    """While no finished request waits for its span (as with unsampled
    parents), the worker's wait doubles up to ``IDLE_POLL_S``; once it finds
    detail it takes the list every ``POLL_S`` again."""
    monkeypatch.setattr(_tracing, "POLL_S", 0.05)
    monkeypatch.setattr(_tracing, "IDLE_POLL_S", 1.0)
    takes: list[tuple[float, int]] = []
    took = threading.Condition()
    take = DetailHandover.take

    def recorded(self: DetailHandover) -> list[tuple[Any, ...]]:
        items = take(self)
        with took:
            takes.append((time.monotonic(), len(items)))
            took.notify_all()
        return items

    monkeypatch.setattr(DetailHandover, "take", recorded)
    harness = SchedulerHarness(build_scheduler(tiny_model, K, per_request_metrics=True))
    time.sleep(2.7)  # idle: waits of 0.05, 0.1, 0.2, 0.4, 0.8, 1.0 s
    idle = [t for t, _ in takes]
    gaps = [b - a for a, b in itertools.pairwise(idle)]
    # A fixed 0.05 s poll would take the list about 54 times.
    assert 2 <= len(idle) <= 7, gaps
    assert gaps[-1] >= 0.75, gaps  # a wait is never shorter than asked
    run(harness, 4, steps=12)
    with took:
        assert took.wait_for(lambda: any(n for _, n in takes), 5), takes
        found = next(i for i, (_, n) in enumerate(takes) if n)
        assert took.wait_for(lambda: len(takes) > found + 1, 5), takes
    assert takes[found + 1][0] - takes[found][0] < 0.75, takes[found:]
    assert len(traced.finished_spans()) == 4
