"""Property-based: random streams of engine steps on vLLM's real scheduler,
through both accounting paths, against vLLM's own counters.

Hypothesis draws the stream: arrivals (prompts of 1 to 20 tokens, 3 to 40
output tokens), aborts between steps and while a step runs, preemptions
(a KV cache too small for the batch), drafts of 0 to k tokens with k capped
anew each step, accepted prefixes of any length (so one to k + 1 sampled
tokens per step), and grammar-invalidated draft tails where the release has
them. The same stream goes through the exact path and the C pass, each on
a scheduler of its own; each must equal vLLM's ``SpecDecodingStats``
(totals, per-position counts, the acceptance-length histogram) and its
per-request counts, and the two must be identical, per-request rates
included. Request spans are on (a parent-based sampler; arrivals come with
a sampled parent, an unsampled one, or none): each path must hand over the
same per-request detail, for exactly the requests the plan keeps, adding
up to vLLM's per-request counts.

Examples are derandomized (the same ones in every run: a failure here is
a bug, never noise); ``SPECDEC_HYPOTHESIS_EXAMPLES`` runs more of them to
explore. Every failing stream found is kept below as an ``@example``.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scheduler_harness import SchedulerHarness, build_scheduler, has_field

from otel_specdec._request_details import DetailHandover, unpack_counts

K = 4
DRAIN_STEPS = 200
# Each scheduler's model name, so each example and path has totals of its own.
_names = itertools.count()

# One step of the plan: (arrivals [(prompt_len, max_tokens)], abort between
# steps (index into the live requests, or None), abort while the step runs
# (index into the scheduled ones, or None), cap on this step's drafts, seed
# of its drafts and verdicts, invalidate draft tails).
_step = st.tuples(
    st.lists(st.tuples(st.sampled_from([1, 8, 20]), st.integers(3, 40)), max_size=3),
    st.none() | st.integers(0, 63),
    st.none() | st.integers(0, 63),
    st.integers(0, K),
    st.integers(0, 2**16),
    st.booleans(),
)
_plan = st.lists(_step, min_size=1, max_size=24)


def _drafts(seed: int, req_id: str, cap: int) -> list[int]:
    return [20 + i for i in range(random.Random(f"{seed}/{req_id}").randint(0, cap))]


def _accept(seed: int, req_id: str, drafts: list[int]) -> int:
    return random.Random(f"{seed}|{req_id}").randint(0, len(drafts))


# Arrivals' trace context, in turn: a sampled parent, an unsampled one, none
# (a header of another name). Each request's headers are its own, so that
# a handed-over detail tells whose it is.
_PARENT = "-00f067aa0ba902b7-"
_KINDS = 3
# The sampler below keeps detail for those with a sampled parent or none.
_KEPT = {0, 2}


def _headers(ordinal: int) -> dict[str, str]:
    kind = ordinal % _KINDS
    if kind == 2:
        return {"x-arrival": str(ordinal)}
    return {"traceparent": f"00-{ordinal + 1:032x}{_PARENT}0{1 - kind}"}


def _key(headers: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(headers.items()))


def _drive(harness: SchedulerHarness, plan: list[Any]) -> dict[str, int]:
    """The stream; returns each request's arrival ordinal (its headers: _headers)."""
    from vllm.v1.core.sched.output import SchedulerOutput

    invalid_supported = has_field(SchedulerOutput, "num_invalid_spec_tokens")
    scheduler = harness.scheduler
    ordinals: dict[str, int] = {}
    for arrivals, abort_between, abort_in_step, cap, seed, invalidate in plan:
        for prompt_len, max_tokens in arrivals:
            headers = _headers(len(ordinals))
            (req_id,) = harness.add_requests(1, prompt_len=prompt_len, max_tokens=max_tokens,
                                             trace_headers=lambda _i, h=headers: h)
            ordinals[req_id] = len(ordinals)
        live = sorted(scheduler.requests)
        if abort_between is not None and live:
            harness.abort(live[abort_between % len(live)])
        so = harness.schedule()
        if invalidate and invalid_supported:
            # What structured-output validation does to a rejected draft tail.
            so.num_invalid_spec_tokens = {}
            for req_id, drafts in so.scheduled_spec_decode_tokens.items():
                if len(drafts) > 1:
                    drafts[-1] = -1
                    so.num_invalid_spec_tokens[req_id] = 1
        scheduled = list(so.num_scheduled_tokens)
        if abort_in_step is not None and scheduled:
            victim = scheduled[abort_in_step % len(scheduled)]
            if victim in scheduler.requests:
                harness.abort(victim)  # while the model runs: vLLM skips its output
        harness.update(so, harness.model_output(so, lambda r, d, s=seed: _accept(s, r, d)))
        harness.propose(so, lambda r, s=seed, c=cap: _drafts(s, r, c))
    for step in range(DRAIN_STEPS):
        if not scheduler.requests:
            break
        harness.step(lambda r, d, s=step: _accept(s, r, d), lambda r, s=step: _drafts(s, r, K))
    for req_id in list(scheduler.requests):
        harness.abort(req_id)
    return ordinals


def _padded(values: list[int]) -> list[int]:
    return (list(values) + [0] * K)[:K]


def _run(tiny_model: str, plan: list[Any], small_cache: bool, native: Any, name: str) -> Any:
    """The plan through one path; its totals and span detail, checked against vLLM's."""
    from otel_specdec import _accounting

    saved, saved_hand_over = _accounting.NATIVE_SCANNER, DetailHandover.hand_over
    handed: dict[Any, tuple[list[int], list[int]]] = {}

    def recording_hand_over(self: DetailHandover, released: Any) -> None:
        for _totals, headers, _status, _first_ns, _end_ns, packed in released:
            assert _key(headers) not in handed
            handed[_key(headers)] = unpack_counts(packed)
        saved_hand_over(self, released)

    _accounting.NATIVE_SCANNER = native
    DetailHandover.hand_over = recording_hand_over  # type: ignore[method-assign]
    try:
        harness = SchedulerHarness(build_scheduler(
            tiny_model, K, per_request_metrics=True, served_model_name=name,
            num_blocks=24 if small_cache else 200_000))
        ordinals = _drive(harness, plan)
    finally:
        _accounting.NATIVE_SCANNER = saved
        DetailHandover.hand_over = saved_hand_over  # type: ignore[method-assign]
    accountant = harness.scheduler.__dict__["_otel_specdec_accountant"][1]
    path = "native" if native is not None else "exact"
    steps = accountant.steps_by_path()
    assert steps[path] > 0 or not harness.vllm.drafts, steps
    totals = accountant.totals
    snapshot = totals.snapshot()
    vllm = harness.vllm
    assert sum(snapshot.accepted_hist) == vllm.drafts
    assert sum(n * c for n, c in enumerate(snapshot.drafted_hist)) == vllm.draft_tokens
    assert sum(a * c for a, c in enumerate(snapshot.accepted_hist)) == vllm.accepted_tokens
    assert snapshot.accepted_per_position(K) == _padded(vllm.accepted_per_pos)
    if vllm.draft_per_pos:  # vLLM counts them from 0.24
        assert snapshot.drafted_per_position(K) == _padded(vllm.draft_per_pos)
    rates = [a / d for d, a in harness.per_request().values() if d]
    assert sum(snapshot.rate_buckets) == len(rates)
    assert snapshot.rate_sum == pytest.approx(sum(rates))
    trackers = sorted(tuple(t) for t in totals.rate_trackers.values())
    per_request = harness.per_request()
    whose = {_key(_headers(ordinal)): req_id for req_id, ordinal in ordinals.items()}
    assert {whose[key] for key in handed} == {
        r for r, (drafted, _) in per_request.items() if drafted and ordinals[r] % _KINDS in _KEPT}
    for key, (accepted_hist, drafted_hist) in handed.items():
        drafted = sum(n * c for n, c in enumerate(drafted_hist))
        accepted = sum(n * c for n, c in enumerate(accepted_hist))
        assert (drafted, accepted) == per_request[whose[key]], whose[key]
    detail = {whose[key]: (_strip(a), _strip(d)) for key, (a, d) in handed.items()}
    return snapshot, trackers, detail


def _strip(counts: list[int]) -> list[int]:
    """Counts without trailing zeros (the two paths size them differently)."""
    while counts and counts[-1] == 0:
        counts = counts[:-1]
    return counts


@pytest.fixture
def traced_reader(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The plugin on a fresh meter provider (in-memory reader) and a tracer
    provider with a parent-based sampler, request spans on."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    from otel_specdec import SpecDecodeInstrumentor

    monkeypatch.setenv("OTEL_SPECDEC_TRACES", "true")
    instrumentor = SpecDecodeInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    memory_reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[memory_reader], shutdown_on_exit=False)
    tracer_provider = TracerProvider(sampler=ParentBased(ALWAYS_ON))
    instrumentor.instrument(meter_provider=meter_provider, tracer_provider=tracer_provider)
    yield memory_reader
    instrumentor.uninstrument()
    meter_provider.shutdown()
    tracer_provider.shutdown()


@settings(max_examples=int(os.environ.get("SPECDEC_HYPOTHESIS_EXAMPLES", "12")),
          deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan=_plan, small_cache=st.booleans())
@example(plan=[([(8, 40)] * 3, None, None, K, 1, False)] * 6, small_cache=True)
def test_random_streams_count_as_vllm_on_both_paths(tiny_model, traced_reader, plan,
                                                    small_cache):
    from otel_specdec import _accounting

    native = _accounting.NATIVE_SCANNER
    assert native is not None, "the C pass was not built"
    tag = next(_names)
    exact = _run(tiny_model, plan, small_cache, None, f"exact-{tag}")
    fast = _run(tiny_model, plan, small_cache, native, f"native-{tag}")
    # The C pass adds a step's rates at once: the float sum may differ in
    # its last bits from the one-by-one sum.
    assert fast[0]._replace(rate_sum=0.0) == exact[0]._replace(rate_sum=0.0)
    assert fast[0].rate_sum == pytest.approx(exact[0].rate_sum, rel=1e-12)
    assert fast[1] == exact[1]
    assert fast[2] == exact[2]
