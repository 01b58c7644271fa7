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
included.

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


def _drive(harness: SchedulerHarness, plan: list[Any]) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    invalid_supported = has_field(SchedulerOutput, "num_invalid_spec_tokens")
    scheduler = harness.scheduler
    for arrivals, abort_between, abort_in_step, cap, seed, invalidate in plan:
        for prompt_len, max_tokens in arrivals:
            harness.add_requests(1, prompt_len=prompt_len, max_tokens=max_tokens)
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


def _padded(values: list[int]) -> list[int]:
    return (list(values) + [0] * K)[:K]


def _run(tiny_model: str, plan: list[Any], small_cache: bool, native: Any, name: str) -> Any:
    """The plan through one path; its totals, checked against vLLM's."""
    from otel_specdec import _accounting

    saved = _accounting.NATIVE_SCANNER
    _accounting.NATIVE_SCANNER = native
    try:
        harness = SchedulerHarness(build_scheduler(
            tiny_model, K, per_request_metrics=True, served_model_name=name,
            num_blocks=24 if small_cache else 200_000))
        _drive(harness, plan)
    finally:
        _accounting.NATIVE_SCANNER = saved
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
    return snapshot, trackers


@settings(max_examples=int(os.environ.get("SPECDEC_HYPOTHESIS_EXAMPLES", "12")),
          deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan=_plan, small_cache=st.booleans())
@example(plan=[([(8, 40)] * 3, None, None, K, 1, False)] * 6, small_cache=True)
def test_random_streams_count_as_vllm_on_both_paths(tiny_model, reader, plan, small_cache):
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
