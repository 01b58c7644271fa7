"""The accounting, on vLLM's real scheduler fed with hand-made model outputs.

Each test drives vLLM's own ``Scheduler`` (see ``scheduler_harness``) and
compares what the plugin exported with vLLM's own ``SpecDecodingStats`` for
the same steps, and with expectations computed from the test's own plan.
Every test runs through both accounting paths: the exact (per-request) one
and the C pass, and checks that the path it names took steps (unusual steps
go to the exact path on both).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from otel_helpers import histogram, per_position, points, total
from scheduler_harness import SchedulerHarness, build_scheduler, has_field, vllm_release

K = 3
DRAFTS = "vllm.spec_decode.drafts"
DRAFT_TOKENS = "vllm.spec_decode.draft_tokens"
ACCEPTED = "vllm.spec_decode.accepted_tokens"
LENGTH = "vllm.spec_decode.acceptance_length"
REQ_RATE = "vllm.spec_decode.request.acceptance_rate"
EMPTY = "vllm.spec_decode.empty_proposals"
PADDING = "vllm.spec_decode.padding_tokens"


def accepted_prefix(mask: list[int]) -> int:
    """Length of the accepted prefix of per-token verdicts (first 0 ends it)."""
    n = 0
    for verdict in mask:
        if not verdict:
            break
        n += 1
    return n


def full_proposal(_req_id: str) -> list[int]:
    return [20 + i for i in range(K)]


def assert_matches_vllm(harness: SchedulerHarness, data) -> None:
    vllm = harness.vllm
    assert total(data, DRAFTS) == vllm.drafts
    assert total(data, DRAFT_TOKENS) == vllm.draft_tokens
    assert total(data, ACCEPTED) == vllm.accepted_tokens
    assert per_position(data, ACCEPTED) == vllm.accepted_per_pos
    if vllm.draft_per_pos:  # vLLM counts them from 0.24
        assert per_position(data, DRAFT_TOKENS) == vllm.draft_per_pos
    length = histogram(data, LENGTH)
    assert length.count == vllm.drafts
    # Mean acceptance length includes the bonus token.
    assert length.sum == vllm.drafts + vllm.accepted_tokens


def assert_matches_vllm_per_request(harness: SchedulerHarness, data, requests: int) -> None:
    """Totals as vLLM's, and one acceptance rate per request, as vLLM's."""
    assert_matches_vllm(harness, data)
    rates = [a / d for d, a in harness.per_request().values() if d]
    point = histogram(data, REQ_RATE)
    assert point.count == len(rates) == requests
    assert point.sum == pytest.approx(sum(rates))


@pytest.fixture(params=["exact", "native"])
def accounting_path(request, monkeypatch) -> Iterator[str]:
    """Run each test through both accounting paths (they must agree with vLLM).

    "exact" is the Python loop (as where the C pass was not built), "native"
    the C pass (``_rowscan``), which every CI install builds.
    """
    from otel_specdec import _accounting

    if request.param == "native":
        assert _accounting.NATIVE_SCANNER is not None, "the C accelerator was not built"
    else:
        monkeypatch.setattr(_accounting, "NATIVE_SCANNER", None)
    accountants: list = []
    original_init = _accounting.StepAccountant.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        accountants.append(self)

    monkeypatch.setattr(_accounting.StepAccountant, "__init__", recording_init)
    yield request.param
    # The path under test took the steps (a path that declined every step
    # would leave the others to pass the test alone).
    steps = {path: sum(a.steps_by_path()[path] for a in accountants)
             for path in ("exact", "native")}
    if not any(steps.values()):
        return  # no step was accounted (a test skipped on this release)
    assert steps[request.param] > 0, steps


@pytest.fixture
def harness(tiny_model, reader, accounting_path) -> SchedulerHarness:
    return SchedulerHarness(build_scheduler(tiny_model, K))


def run(harness: SchedulerHarness, steps: int, accept, propose=full_proposal) -> None:
    for _ in range(steps):
        harness.step(accept, propose)


def test_seed_example_counts_only_the_accepted_prefix(harness, reader):
    # Drafts [t1, t2, t3]; the target agrees with t1, rejects t2, would agree
    # with t3: per-token verdicts [1, 0, 1]. Only t1 is accepted.
    harness.add_requests(1)
    harness.step(lambda r, d: 0, full_proposal)  # prefill; drafter proposes t1..t3
    before = harness.vllm.drafts
    harness.step(lambda r, d: accepted_prefix([1, 0, 1]), full_proposal)
    data = reader.get_metrics_data()
    assert harness.vllm.drafts - before == 1
    assert total(data, DRAFTS) == 1
    assert total(data, DRAFT_TOKENS) == 3
    assert total(data, ACCEPTED) == 1
    assert per_position(data, ACCEPTED) == [1, 0, 0]
    assert per_position(data, DRAFT_TOKENS) == [1, 1, 1]
    assert_matches_vllm(harness, data)


@pytest.mark.parametrize("accepted", [K, 0], ids=["all-accepted", "none-accepted"])
def test_all_or_none_accepted(harness, reader, accepted):
    harness.add_requests(5)
    run(harness, 12, lambda r, d: min(accepted, len(d)))
    data = reader.get_metrics_data()
    assert_matches_vllm(harness, data)
    drafts = harness.vllm.drafts
    assert drafts > 0
    assert total(data, ACCEPTED) == drafts * accepted
    assert per_position(data, ACCEPTED) == [drafts if i < accepted else 0 for i in range(K)]
    length = histogram(data, LENGTH)
    assert length.explicit_bounds == tuple(float(i) for i in range(1, K + 2))
    assert length.bucket_counts[accepted] == drafts
    assert length.min == length.max == 1 + accepted


def test_variable_length_ngram_drafts_and_empty_proposals(harness, reader):
    ids = harness.add_requests(6)
    lengths = {r: i % (K + 1) for i, r in enumerate(ids)}  # 0..K, 0 = ngram miss
    decode_steps_without_draft = 0

    def propose(req_id: str) -> list[int]:
        return [30 + i for i in range(lengths[req_id])]

    harness.step(lambda r, d: 0, propose)  # prefill
    for step in range(10):
        so = harness.schedule()
        decode_steps_without_draft += sum(
            1 for r in so.num_scheduled_tokens if r not in so.scheduled_spec_decode_tokens
        )
        harness.update(
            so, harness.model_output(so, lambda r, d, s=step: (s + len(d)) % (len(d) + 1))
        )
        harness.propose(so, propose)
    data = reader.get_metrics_data()
    assert_matches_vllm(harness, data)
    expected_drafted = [sum(1 for n in lengths.values() if n > i) * 10 for i in range(K)]
    assert per_position(data, DRAFT_TOKENS) == expected_drafted
    never_drafted = sum(1 for n in lengths.values() if n == 0)
    assert decode_steps_without_draft == 10 * never_drafted
    assert total(data, EMPTY) == decode_steps_without_draft


def test_grammar_invalidated_drafts_are_not_drafted(harness, reader):
    from vllm.v1.core.sched.output import SchedulerOutput

    if not has_field(SchedulerOutput, "num_invalid_spec_tokens"):
        pytest.skip("this vLLM has no grammar-invalidated drafts (added in 0.14)")
    ids = harness.add_requests(3)
    harness.step(lambda r, d: 0, full_proposal)
    invalidated = 0
    for _ in range(6):
        so = harness.schedule()
        # What vLLM's structured-output validation does to a rejected draft
        # tail: replace it with -1 and record how many were invalid.
        so.num_invalid_spec_tokens = {}
        for req_id in ids[:2]:
            drafts = so.scheduled_spec_decode_tokens[req_id]
            drafts[-1] = -1
            so.num_invalid_spec_tokens[req_id] = 1
            invalidated += 1
        harness.update(so, harness.model_output(so, lambda r, d: 1))
        harness.propose(so, full_proposal)
    data = reader.get_metrics_data()
    assert_matches_vllm(harness, data)
    assert total(data, DRAFT_TOKENS) == harness.vllm.drafts * K - invalidated
    assert total(data, PADDING) == 0  # invalid slots are not padding


def test_finished_and_aborted_requests_in_the_step_are_skipped(harness, reader):
    from vllm.v1.request import RequestStatus

    ids = harness.add_requests(4, max_tokens=6)  # finish by length mid-run
    harness.step(lambda r, d: 0, full_proposal)
    so = harness.schedule()
    # Aborted while the model ran: vLLM skips its output.
    harness.scheduler.finish_requests(ids[0], RequestStatus.FINISHED_ABORTED)
    harness.update(so, harness.model_output(so, lambda r, d: 1))
    harness.propose(so, full_proposal)
    run(harness, 8, lambda r, d: 2)
    assert not harness.scheduler.requests  # all finished
    data = reader.get_metrics_data()
    assert_matches_vllm(harness, data)


def test_request_freed_where_no_hook_sees_it_is_skipped_and_counted_once(harness, reader):
    # Freed between schedule and update by a path the plugin does not hook
    # (finish_requests unwrapped): vLLM skips its output; the plugin learns
    # of it from vLLM's set of freed requests and must skip it too, and
    # record its rate once.
    from vllm.v1.request import RequestStatus

    ids = harness.add_requests(6, max_tokens=30)
    run(harness, 3, lambda r, d: 1)
    so = harness.schedule()
    unhooked_finish = type(harness.scheduler).finish_requests.__wrapped__
    unhooked_finish(harness.scheduler, ids[2], RequestStatus.FINISHED_ABORTED)
    harness.update(so, harness.model_output(so, lambda r, d: 2))
    harness.propose(so, full_proposal)
    run(harness, 20, lambda r, d: 2)
    assert not harness.scheduler.requests
    data = reader.get_metrics_data()
    assert_matches_vllm(harness, data)
    assert histogram(data, REQ_RATE).count == len(ids)


def test_request_acceptance_rate_one_value_per_finished_request(harness, reader):
    ids = harness.add_requests(4, max_tokens=40)
    accepted = {r: i % (K + 1) for i, r in enumerate(ids)}  # 0, 1, 2, 3 of 3
    run(harness, 40, lambda r, d: min(accepted[r], len(d)))
    assert not harness.scheduler.requests
    data = reader.get_metrics_data()
    point = histogram(data, REQ_RATE)
    # Per request: its accepted over its drafted tokens, as counted by the
    # harness (and checked against vLLM's counters). Some releases (0.11)
    # shorten the last drafts of a request near max_tokens, so the rate is
    # not always accepted[r] / K.
    per_request = harness.per_request()
    rates = [per_request[r][1] / per_request[r][0] for r in ids]
    if all(d % K == 0 for d, _ in per_request.values()):
        assert rates == [accepted[r] / K for r in ids]
    assert point.count == len(ids)
    assert point.sum == pytest.approx(sum(rates))
    assert point.min == min(rates) and point.max == max(rates)
    assert point.explicit_bounds == tuple(i / 10 for i in range(11))
    import bisect

    expected = [0] * 12
    for rate in rates:
        expected[bisect.bisect_left(point.explicit_bounds, rate)] += 1
    assert list(point.bucket_counts) == expected


def test_counts_without_vllm_stats_logging(tiny_model, reader):
    # Two identical schedulers, one with vLLM's own stats off: the plugin's
    # numbers for the second equal vLLM's numbers for the first.
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: F401

    with_stats = SchedulerHarness(build_scheduler(tiny_model, K, log_stats=True))
    with_stats.add_requests(3)
    run(with_stats, 10, lambda r, d: 1)
    first = reader.get_metrics_data()
    without = SchedulerHarness(build_scheduler(tiny_model, K, log_stats=False))
    without.add_requests(3)
    run(without, 10, lambda r, d: 1)
    assert without.vllm.drafts == 0  # vLLM itself counted nothing
    second = reader.get_metrics_data()
    assert total(second, DRAFTS) - total(first, DRAFTS) == with_stats.vllm.drafts
    assert total(second, ACCEPTED) - total(first, ACCEPTED) == with_stats.vllm.accepted_tokens


def test_common_attributes_and_no_request_data(harness, reader):
    harness.add_requests(2)
    run(harness, 4, lambda r, d: 1)
    data = reader.get_metrics_data()
    for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED, LENGTH):
        for point in points(data, name):
            assert point.attributes["vllm.spec_decode.method"] == "ngram"
            assert point.attributes["vllm.spec_decode.num_speculative_tokens"] == K
            assert point.attributes["gen_ai.request.model"]
            values = [str(v) for v in point.attributes.values()]
            assert not any(v.startswith("req-") for v in values)
    scopes = {sm.scope.name: sm.scope.version for rm in data.resource_metrics
              for sm in rm.scope_metrics}
    from otel_specdec import __version__

    assert scopes == {"otel_specdec": __version__}


@pytest.mark.parametrize(
    ("row_order", "sweep_every"),
    [("persistent", None), ("schedule", None), ("shuffled", None), ("persistent", 3)],
)
def test_per_request_rates_match_vllm_under_churn(tiny_model, reader, accounting_path,
                                                  row_order, sweep_every, monkeypatch):
    # Requests arrive and finish throughout, so batch rows change owner; the
    # per-request rates equal vLLM's own per-request counts, whatever the
    # model runner's row layout. With sweep_every, the periodic sweep of
    # tallies left by vanished requests (every 4096 steps in service) runs
    # every few steps: it must keep every live request's tally.
    import random

    from otel_specdec import _accounting

    if sweep_every is not None:
        monkeypatch.setattr(_accounting, "_SWEEP_EVERY_STEPS", sweep_every)

    harness = SchedulerHarness(
        build_scheduler(tiny_model, K, per_request_metrics=True), row_order=row_order
    )
    rng = random.Random(7)
    step_no = [0]

    def accept(req_id: str, d: list[int]) -> int:
        return (hash(req_id) * 7 + step_no[0]) % (len(d) + 1)

    def propose(req_id: str) -> list[int]:
        # Drafts of varying length, and no draft at all now and then (ngram misses).
        return full_proposal(req_id)[: (hash(req_id) + step_no[0]) % (K + 2)]

    empty_expected = 0
    for step in range(120):
        step_no[0] = step
        if step < 80 and len(harness.scheduler.requests) < 40:
            for _ in range(rng.randint(1, 6)):
                # One-token prompts prefill in a one-token step: not an empty proposal.
                harness.add_requests(1, prompt_len=rng.choice([1, 8]),
                                     max_tokens=rng.randint(4, 40))
        so = harness.schedule()
        requests = harness.scheduler.requests
        if step % 7 == 3 and so.num_scheduled_tokens:
            # Aborted while the model runs: vLLM skips its output, so must we.
            harness.abort(rng.choice(list(so.num_scheduled_tokens)))
        empty_expected += sum(
            1 for r, n in so.num_scheduled_tokens.items()
            if n == 1 and r not in so.scheduled_spec_decode_tokens
            and r in requests and requests[r].num_output_tokens > 0
        )
        harness.update(so, harness.model_output(so, accept))
        harness.propose(so, propose)
    assert not harness.scheduler.requests
    data = reader.get_metrics_data()
    assert_matches_vllm(harness, data)
    assert empty_expected > 50
    assert total(data, EMPTY) == empty_expected
    rates = [a / d for d, a in harness.per_request().values() if d]
    assert len(rates) > 60
    point = histogram(data, REQ_RATE)
    assert point.count == len(rates)
    assert point.sum == pytest.approx(sum(rates))
    assert (point.min, point.max) == (min(rates), max(rates))
    import bisect

    expected = [0] * (len(point.explicit_bounds) + 1)
    for rate in rates:
        expected[bisect.bisect_left(point.explicit_bounds, rate)] += 1
    assert list(point.bucket_counts) == expected


def skip_without_async_speculation() -> None:
    if vllm_release() < (0, 11):
        pytest.skip("vLLM's AsyncScheduler speculates from 0.11 (before: a TODO)")


def test_async_scheduling_steps_in_flight_with_aborts(tiny_model, reader, accounting_path):
    # vLLM's AsyncScheduler schedules step N+1 before step N's output arrives.
    # A request aborted meanwhile is in both steps in flight; vLLM skips it in
    # both, and so must the plugin.
    import collections

    skip_without_async_speculation()

    harness = SchedulerHarness(
        build_scheduler(tiny_model, K, async_scheduling=True, per_request_metrics=True)
    )
    ids = harness.add_requests(12, max_tokens=40)
    in_flight: collections.deque = collections.deque()
    for step in range(60):
        so = harness.schedule()
        in_flight.append((so, harness.model_output(so, lambda r, d, s=step: (s + len(r)) % 3)))
        if step in (4, 7, 10):
            harness.abort(next(r for r in ids if r in harness.scheduler.requests))
        if len(in_flight) == 2:
            done, output = in_flight.popleft()
            harness.update(done, output)
            harness.propose(done, full_proposal)
    while in_flight:
        done, output = in_flight.popleft()
        harness.update(done, output)
    assert not harness.scheduler.requests
    data = reader.get_metrics_data()
    assert harness.vllm.drafts > 100
    assert_matches_vllm(harness, data)
    rates = [a / d for d, a in harness.per_request().values() if d]
    point = histogram(data, REQ_RATE)
    assert point.count == len(rates) == len(ids)
    assert point.sum == pytest.approx(sum(rates))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_requests_match_vllm(tiny_model, reader, accounting_path, async_scheduling):
    # A KV cache too small for the batch: vLLM preempts running requests and
    # resumes them later. With a step in flight (async scheduling) a
    # preempted request's in-flight output is stale, and vLLM drops it.
    import collections

    from vllm.v1.request import RequestStatus

    if async_scheduling:
        skip_without_async_speculation()

    harness = SchedulerHarness(build_scheduler(
        tiny_model, K, async_scheduling=async_scheduling, per_request_metrics=True,
        num_blocks=24,
    ))
    preempted = []
    scheduler = harness.scheduler
    ids = harness.add_requests(16, prompt_len=8, max_tokens=60)
    depth = 2 if async_scheduling else 1
    in_flight: collections.deque = collections.deque()
    stale_steps = 0
    for step in range(400):
        if not scheduler.requests and not in_flight:
            break
        so = harness.schedule()
        preempted += [r.request_id for r in scheduler.requests.values()
                      if r.status == RequestStatus.PREEMPTED]
        in_flight.append((so, harness.model_output(so, lambda r, d, s=step: (s + len(r)) % 4)))
        if len(in_flight) == depth:
            done, output = in_flight.popleft()
            stale_steps += any(getattr(r, "num_stale_output_tokens", 0)
                               for r in scheduler.requests.values())
            harness.update(done, output)
            harness.propose(done, full_proposal)
    while in_flight:
        harness.update(*in_flight.popleft())
    assert not scheduler.requests
    assert len(preempted) >= 3
    if async_scheduling and vllm_release() >= (0, 27):
        assert stale_steps > 0  # the case this test is for (stale output: vLLM 0.27+)
    assert_matches_vllm_per_request(harness, reader.get_metrics_data(), len(ids))


def test_dynamic_speculative_decoding_k_follows_the_batch(tiny_model, reader, accounting_path):
    # vLLM 0.24+: num_speculative_tokens_per_batch_size picks k for each step
    # from the number of requests scheduled (at most num_speculative_tokens).
    # Positions and acceptance-length buckets stay those of the configured
    # maximum, as vLLM's own per-position counters do; each draft counts at
    # the positions it had.
    from vllm.config import SpeculativeConfig

    if "num_speculative_tokens_per_batch_size" not in SpeculativeConfig.__dataclass_fields__:
        pytest.skip("this vLLM has no dynamic speculative decoding (added in 0.24)")
    k_max = 4
    schedule = [(1, 3, 4), (4, 8, 2), (9, 1024, 1)]
    harness = SchedulerHarness(build_scheduler(
        tiny_model, k_max, speculative_extra={"num_speculative_tokens_per_batch_size": schedule},
    ))
    assert harness.scheduler.dynamic_sd_lookup is not None
    import random

    rng = random.Random(3)
    draft_lengths: set[int] = set()
    for step in range(90):
        # Waves of arrivals: the batch grows past 8 and shrinks to 1.
        if step % 30 == 0:
            harness.add_requests(12, max_tokens=rng.randint(30, 60))
        so = harness.schedule()
        draft_lengths.update(map(len, so.scheduled_spec_decode_tokens.values()))
        k_next = so.num_spec_tokens_to_schedule
        harness.update(so, harness.model_output(so, lambda r, d: rng.randint(0, len(d))))
        # The drafter proposes the k chosen for this step's batch.
        harness.propose(so, lambda r, k=k_next: [20 + i for i in range(k)])
    assert {1, 2, 4} <= draft_lengths  # the case this test is for
    data = reader.get_metrics_data()
    assert_matches_vllm(harness, data)
    assert len(per_position(data, DRAFT_TOKENS)) == k_max
    length = histogram(data, LENGTH)
    assert length.explicit_bounds == tuple(float(i) for i in range(1, k_max + 2))
    for point in points(data, DRAFT_TOKENS):
        assert point.attributes["vllm.spec_decode.num_speculative_tokens"] == k_max


def test_finished_request_held_by_a_kv_connector_is_skipped(tiny_model, reader,
                                                           accounting_path):
    # A KV connector that delays frees (a disaggregated-prefill producer)
    # keeps finished requests in the scheduler's table. With a step in
    # flight such a request is in the next step's output, and vLLM skips it
    # because it is finished, not because it is gone.
    import collections

    import delaying_kv_connector

    skip_without_async_speculation()
    if vllm_release() < (0, 16):
        pytest.skip("vLLM counts finished requests still in its table before 0.16 "
                    "(docs/compatibility.md)")
    harness = SchedulerHarness(build_scheduler(
        tiny_model, K, async_scheduling=True, per_request_metrics=True,
        kv_transfer_config={"kv_connector": delaying_kv_connector.CLASS,
                            "kv_connector_module_path": delaying_kv_connector.MODULE,
                            "kv_role": "kv_both"},
    ))
    assert type(harness.scheduler.connector).__name__ == delaying_kv_connector.CLASS
    ids = harness.add_requests(6, max_tokens=9) + harness.add_requests(6, max_tokens=14)
    in_flight: collections.deque = collections.deque()
    held_rows = 0
    for step in range(40):
        so = harness.schedule()
        in_flight.append((so, harness.model_output(so, lambda r, d, s=step: (s + len(r)) % 4)))
        if len(in_flight) == 2:
            done, output = in_flight.popleft()
            requests = harness.scheduler.requests
            held_rows += sum(1 for r in done.scheduled_spec_decode_tokens
                             if r in requests and requests[r].is_finished())
            harness.update(done, output)
            harness.propose(done, full_proposal)
    while in_flight:
        done, output = in_flight.popleft()
        harness.update(done, output)
    assert held_rows > 0  # the case under test happened
    assert all(harness.scheduler.requests[r].is_finished() for r in ids)  # all held
    assert_matches_vllm_per_request(harness, reader.get_metrics_data(), len(ids))


def _churn_stream(harness: SchedulerHarness) -> None:
    """A fixed stream: arrivals, varied drafts (empty, short, padded), aborts
    while a step is in flight, finishing requests."""
    import random

    rng = random.Random(11)
    for step in range(90):
        if step < 60 and len(harness.scheduler.requests) < 48:
            harness.add_requests(rng.randint(0, 5), prompt_len=rng.choice([1, 8]),
                                 max_tokens=rng.randint(3, 30))
        so = harness.schedule()
        if step % 9 == 4 and so.num_scheduled_tokens:
            harness.abort(rng.choice(sorted(so.num_scheduled_tokens)))
        output = harness.model_output(so, lambda r, d, s=step: (len(r) * 3 + s) % (len(d) + 1))
        harness.update(so, output)

        def propose(req_id: str, s: int = step) -> list[int]:
            n = (len(req_id) + s) % (K + 2)
            drafts = [20 + i for i in range(min(n, K))]
            return drafts[:-1] + [-1] if n == K + 1 and drafts else drafts  # padded now and then

        harness.propose(so, propose)


def test_one_stream_gives_identical_totals_through_every_implementation(tiny_model, reader,
                                                                       monkeypatch):
    # The same stream through the exact path (the reference) and the C pass:
    # every total, empty proposals, padding
    # and the per-request rate histogram (buckets, sum, min, max) agree
    # exactly, and each took its own path.
    from otel_specdec import _accounting

    native = _accounting.NATIVE_SCANNER
    assert native is not None, "the C accelerator was not built"
    results = {}
    for path, scanner in (("exact", None), ("native", native)):
        monkeypatch.setattr(_accounting, "NATIVE_SCANNER", scanner)
        harness = SchedulerHarness(build_scheduler(tiny_model, K, served_model_name=path))
        _churn_stream(harness)
        accountant = harness.scheduler.__dict__["_otel_specdec_accountant"][1]
        steps = accountant.steps_by_path()
        assert steps[path] > 0, (path, steps)
        totals = accountant.totals
        tracker_min_max = sorted(tuple(t) for t in totals.rate_trackers.values())
        results[path] = (totals.snapshot(), tracker_min_max, harness.vllm)
    reference = results["exact"]
    assert reference[0].accepted_hist[1:] and sum(reference[0].rate_buckets) > 30
    assert reference[0].empty_proposals > 0 and reference[0].padding_tokens > 0
    for path in ("native",):
        snapshot = results[path][0]
        # The C pass adds a step's rates to the sum at once: the float sum
        # may differ in its last bits from the one-by-one sum.
        assert snapshot._replace(rate_sum=0.0) == reference[0]._replace(rate_sum=0.0), path
        assert snapshot.rate_sum == pytest.approx(reference[0].rate_sum, rel=1e-12), path
        assert results[path][1] == reference[1], path
    assert results["exact"][2] == results["native"][2]  # vLLM saw the same stream
