"""Speculative-decoding accounting, identical to vLLM's own, on plain data.

This is the hot path: ``StepAccountant.step_fast`` (the C pass, where the
optional accelerator was built) or ``StepAccountant.observe_step`` runs
inside the engine's ``Scheduler.update_from_output`` for every step. It makes no
OpenTelemetry call and allocates nothing per request that outlives the
step except the per-request tally. Everything OpenTelemetry needs is derived
at collection time from two histograms of small integers:

* ``accepted_hist[a]``: drafts whose accepted prefix had ``a`` tokens;
* ``drafted_hist[n]``: drafts that verified ``n`` draft tokens.

From them follow, exactly: drafts = sum(hist); accepted tokens at position
``i`` = drafts with ``a > i``; drafted tokens at position ``i`` = drafts with
``n > i``; the acceptance-length histogram (value ``1 + a``) is
``accepted_hist`` itself.

The rules (vLLM ``Scheduler.update_from_output`` and
``make_spec_decoding_stats``):

* a request-step is a draft when it had scheduled draft tokens and produced
  output (a step whose output is empty is not verified);
* accepted tokens = sampled tokens - 1 (the sampler emits the accepted
  prefix plus one bonus or recovered token, so the count stops at the first
  rejection);
* grammar-invalidated draft tokens are subtracted from the drafted count;
* requests that are unknown, finished, aborted or whose output is stale in
  that step are skipped, as are requests whose KV load failed.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import compress, filterfalse, repeat
from operator import attrgetter
from typing import Any

from otel_specdec._instruments import REQUEST_RATE_BOUNDS
from otel_specdec._request_details import DetailHandover, RequestDetails
from otel_specdec._totals import EMPTY_PROPOSALS, PADDING_TOKENS, STEP_COUNTS, SpecDecodeTotals
from otel_specdec._vllm_compat import (
    CURRENT_RULES,
    STEP_FIELDS,
    AccountingRules,
    StepFields,
    is_decoding,
    step_inputs,
)

try:
    from otel_specdec._rowscan import Scanner as NATIVE_SCANNER
except ImportError:  # built without a C compiler: the exact path serves
    NATIVE_SCANNER = None

__all__ = [
    "NATIVE_SCANNER",
    "StepAccountant",
]


# Spilled tallies of requests that vanished without being freed are swept.
_SWEEP_EVERY_STEPS = 4096
# Released request ids are kept a few steps (see release); pruned this often,
# on every path (the C pass is given the same interval).
_PRUNE_FREED_EVERY_STEPS = 8

_IS_ONE = (1).__eq__
_STATUS = attrgetter("status")
_NUM_OUTPUT_TOKENS = attrgetter("num_output_tokens")


class _Gone:
    """Stands in for a request no longer in the scheduler."""

    num_output_tokens = 0
    status = 1 << 30  # above every status: counts as finished

    def __getattr__(self, name: str) -> int:
        return 0  # a stale-output count of this release's, under its own name


_GONE = _Gone()


class RequestTallies:
    """Each request's (drafted, accepted) over its life, by request id: the
    exact path's tallies where the C pass was not built (the C pass keeps
    them by row, behind the same methods)."""

    __slots__ = ("spilled",)

    def __init__(self) -> None:
        self.spilled: dict[str, tuple[int, int]] = {}

    def add_spilled(self, req_id: str, drafted: int, accepted: int) -> None:
        previous = self.spilled.get(req_id)
        if previous is not None:
            drafted += previous[0]
            accepted += previous[1]
        self.spilled[req_id] = (drafted, accepted)

    def take(self, req_id: str) -> tuple[int, int]:
        """Remove and return a request's tally."""
        return self.spilled.pop(req_id, (0, 0))

    def drop_missing(self, live: Mapping[str, object]) -> None:
        """Forget the tallies of requests not in ``live`` (never freed)."""
        for req_id in [r for r in self.spilled if r not in live]:
            del self.spilled[req_id]

    def clear(self) -> None:
        self.spilled.clear()


class StepAccountant:
    """Per-scheduler accounting: feeds one ``SpecDecodeTotals`` each step.

    The patch calls two methods: ``account_step`` before the host's update
    and ``end_step`` after it. Everything else is chosen here, once, at
    construction (the C pass where it was built) and per step (a step the C
    pass declines goes to the exact path).

    Two paths compute the same numbers. The exact path is a Python loop
    that follows vLLM's own loop request by request: it is the reference,
    serves every unusual step (grammar-invalidated drafts, failed KV loads,
    stale output after a preemption, several sampled tokens per step,
    outputs not in row order) and every step where the C pass was not built.
    Where it was built, every other step is taken by ``step_fast``
    (``_rowscan.Scanner.step``: one call per step, which reads the step's
    inputs, passes over the rows once with tallies kept by row in C arrays,
    and adds to the totals itself).

    Finished requests are released in bulk (``release``) from vLLM's own
    sets of freed requests: each tally becomes one per-request rate.

    With request spans on (``details``: the span worker's hand-over), the
    per-request detail a span needs is kept where the counts are: by the C
    pass in its rows, by the exact path in the C pass's store (or in
    ``RequestDetails`` without it).
    """

    __slots__ = (
        "totals",
        "fields",
        "step_fast",
        "end_step",
        "_requests",
        "_tallies",
        "_scanner",
        "_num_sampled",
        "_track_padding",
        "_stale_possible",
        "_check_stale",
        "_stale_tokens",
        "_stale_drop_flag",
        "_skip_finished",
        "_finished_above",
        "_freed",
        "_freed_keep_steps",
        "_step",
        "_details",
        "_add_detail",
        "_handover",
    )

    def __init__(
        self,
        totals: SpecDecodeTotals,
        requests: Mapping[str, Any],
        *,
        num_sampled_per_step: int = 1,
        track_padding: bool = True,
        steps_in_flight: int = 1,
        finished_above: int | None = None,
        details: DetailHandover | None = None,
        fields: StepFields = STEP_FIELDS,
        rules: AccountingRules = CURRENT_RULES,
    ) -> None:
        self.totals = totals
        # The running vLLM's step fields (None: absent) and counting rules.
        self.fields = fields
        self._skip_finished = rules.skips_finished
        # A released request's id is remembered while steps scheduled before
        # it was freed can still arrive, and while it can still be in one of
        # vLLM's sets of freed requests (two schedules).
        self._freed_keep_steps = steps_in_flight + 3
        self._requests = requests
        # The C pass (one pass per step, tallies by row) where it was built;
        # otherwise the exact path's tallies by request.
        self._scanner: Any = None
        self._tallies: Any = RequestTallies()
        if NATIVE_SCANNER is not None and type(requests) is dict:
            # A release that counts finished requests still in the table
            # (rules.skips_finished false) needs each row looked up there,
            # as with steps in flight, rather than told by the freed set.
            # With steps in flight a row's request can be finished and still
            # in the table (a KV connector delaying its free): skipped, as
            # vLLM skips it, where the rules say so.
            # With request spans on it keeps their detail too, in its rows;
            # the hand-over decides which requests keep it and takes what
            # finished requests kept (once per call, where there are any).
            self._scanner = self._tallies = NATIVE_SCANNER(
                totals, requests, REQUEST_RATE_BOUNDS, fields._asdict(), STEP_COUNTS,
                track_padding=track_padding,
                in_flight=steps_in_flight > 0 or not rules.skips_finished,
                skip_finished=rules.skips_finished, finished_above=finished_above,
                keep_steps=self._freed_keep_steps, prune_every=_PRUNE_FREED_EVERY_STEPS,
                sweep_every=_SWEEP_EVERY_STEPS,
                **({} if details is None else {
                    "detail_decide": None if details.plan.keeps_all() else details.decide,
                    "detail_release": details.hand_over}),
            )
        self._num_sampled = num_sampled_per_step
        # Under async scheduling every scheduled draft is a -1 placeholder,
        # so padding cannot be told apart there.
        self._track_padding = track_padding
        # Stale output exists only where a step can be in flight when a
        # request is preempted (async scheduling, pipeline parallelism).
        self._stale_tokens = fields.stale_tokens
        self._stale_drop_flag = rules.stale_drop_flag
        self._stale_possible = steps_in_flight > 0 and self._stale_tokens is not None
        self._check_stale: bool | None = None
        # Statuses above this are finished (see _vllm_compat); None: ask the request.
        self._finished_above = finished_above
        # req_id -> step at which it was freed. A freed request can still be in
        # a step that was in flight; vLLM skips it there, so must we.
        self._freed: dict[str, int] = {}
        self._step = 0
        # Request detail for spans: the C pass keeps it (the exact path adds
        # a Python-path step's to its store); without it, RequestDetails,
        # fed by the exact path only.
        scanner = self._scanner
        self._details: RequestDetails | None = None
        self._add_detail: Any = None
        self._handover = details
        if details is not None:
            if scanner is not None:
                self._add_detail = scanner.add_detail
            else:
                self._details = RequestDetails(totals, details)
                self._add_detail = self._details.add
        # What account_step and end_step use each step: the C pass's step
        # (None: observe_step), and release or the C pass's own.
        fast = scanner is not None and num_sampled_per_step == 1
        self.step_fast: Any = scanner.step if fast else None
        # After the host's update (see end_step); the C pass's own where it
        # serves, saving a Python call per step.
        self.end_step: Any = scanner.end_step if fast else self._end_step

    def account_step(self, scheduler_output: Any, model_runner_output: Any,
                     freed: Collection[str] | None) -> None:
        """The step, before the host's update: the one entry point of the patch.

        ``freed``: the scheduler's requests freed since the step's schedule.
        The C pass takes the step where it can (True: done; a tuple: done
        but for rows it leaves to Python; None: declined, nothing changed);
        otherwise the exact path takes it from the step's inputs.
        """
        step_fast = self.step_fast
        if step_fast is not None:
            done = step_fast(scheduler_output, model_runner_output, freed)
            if done is True:
                return
            if done is not None:
                self.finish_fast_step(done)
                return
        if freed:
            self.release(freed)
        self.observe_step(*step_inputs(scheduler_output, model_runner_output, self.fields))

    def _end_step(self, finished: Collection[str] | None) -> None:
        """``end_step``: after the host's update, the requests it finished
        are released (and the step's batch index let go)."""
        self.release(finished, True)

    def finish_fast_step(self, leftovers: tuple[list[str] | None, list[tuple[int, int]] | None]
                         ) -> None:
        """What ``step_fast`` left to Python (a tuple result).

        Suspects: one-token rows without a draft whose request it could not
        tell was decoding (a new owner in the row, no output last step).
        Overflow: drafts too long for its counts, (accepted, drafted).
        """
        suspects, overflow = leftovers
        totals = self.totals
        if suspects:
            requests = self._requests
            empty = sum(1 for req_id in suspects if is_decoding(requests.get(req_id)))
            if empty:
                totals.step_counts[EMPTY_PROPOSALS] += empty
        for accepted, drafted in overflow or ():
            _add_counts(totals, totals.accepted_hist, ((accepted, 1),))
            _add_counts(totals, totals.drafted_hist, ((drafted, 1),))

    def observe_step(
        self,
        spec_tokens: Mapping[str, Sequence[int]],
        num_scheduled_tokens: Mapping[str, int],
        sampled_token_ids: Sequence[Sequence[int]] | None,
        req_id_to_index: Mapping[str, int],
        invalid_spec_tokens: Mapping[str, int] | None = None,
        skip_ids: Iterable[str] | None = None,
        released_ids: Collection[str] | None = None,
    ) -> None:
        """Account one scheduler step, from the step's inputs only.

        ``released_ids``: requests freed since the last schedule (the step's
        ``finished_req_ids``), released here if no hook released them.
        """
        self._step += 1
        scanner = self._scanner
        if scanner is not None:
            scanner.advance()  # its released ids are pruned by its step count
        if self._check_stale is None and self._requests:
            self._check_stale = self._stale_possible and hasattr(
                next(iter(self._requests.values())), self._stale_tokens
            )
            if scanner is not None:
                scanner.check_stale = self._check_stale
        skip = set(skip_ids) if skip_ids else None
        if released_ids:
            self.release(released_ids)
        if spec_tokens:
            self._observe_exact(
                spec_tokens, sampled_token_ids, req_id_to_index, invalid_spec_tokens, skip
            )
        empty = self._count_empty_proposals(
            spec_tokens, num_scheduled_tokens, sampled_token_ids, req_id_to_index
        )
        if empty:
            self.totals.step_counts[EMPTY_PROPOSALS] += empty
        if self._step % _PRUNE_FREED_EVERY_STEPS == 0 and self._freed:
            self._prune_freed()
        if self._step % _SWEEP_EVERY_STEPS == 0:
            if scanner is None:  # the C pass sweeps its own (advance above)
                self._tallies.drop_missing(self._requests)
            if self._details is not None:
                self._details.drop_missing(self._requests)

    def _observe_exact(
        self,
        spec_tokens: Mapping[str, Sequence[int]],
        sampled_token_ids: Sequence[Sequence[int]] | None,
        req_id_to_index: Mapping[str, int],
        invalid_spec_tokens: Mapping[str, int] | None,
        skip: set[str] | None,
    ) -> None:
        """vLLM's loop, request by request."""
        requests = self._requests
        check_stale = self._check_stale
        totals = self.totals
        accepted_hist = totals.accepted_hist
        drafted_hist = totals.drafted_hist
        add_tally = self._tallies.add_spilled
        num_sampled = self._num_sampled
        track_padding = self._track_padding
        finished_above = self._finished_above if self._skip_finished else None
        skip_finished = self._skip_finished
        stale_tokens = self._stale_tokens
        stale_drop_flag = self._stale_drop_flag
        add_detail = self._add_detail
        now_ns = time.time_ns() if add_detail is not None else 0
        padding = 0

        for req_id, drafts in spec_tokens.items():
            if not drafts:
                continue
            request = requests.get(req_id)
            if request is None:
                continue
            if finished_above is not None:
                if request.status > finished_above:
                    continue
            elif skip_finished and request.is_finished():
                continue
            if skip is not None and req_id in skip:
                continue
            if (
                check_stale
                and getattr(request, stale_tokens) > 0
                and (stale_drop_flag is None or getattr(request, stale_drop_flag))
            ):
                continue  # in-flight output vLLM drops
            # len(): vLLM 0.11 hands each row over as a numpy array.
            num_generated = (
                len(sampled_token_ids[req_id_to_index[req_id]]) if sampled_token_ids else 0
            )
            if not num_generated and num_sampled:
                continue
            num_drafted = len(drafts)
            num_accepted = num_generated - num_sampled
            if num_accepted < 0:
                num_accepted = 0
            invalid = invalid_spec_tokens.get(req_id, 0) if invalid_spec_tokens else 0
            if track_padding and drafts[-1] < 0:
                padding += drafts.count(-1) - invalid
            num_drafted -= invalid
            if max(num_accepted, num_drafted) >= len(accepted_hist):
                totals.grow(max(num_accepted, num_drafted) + 1)
            accepted_hist[num_accepted] += 1
            drafted_hist[num_drafted] += 1
            add_tally(req_id, num_drafted, num_accepted)
            if add_detail is not None:
                add_detail(req_id, request, num_drafted, num_accepted, now_ns)

        if padding:
            totals.step_counts[PADDING_TOKENS] += padding

    def _prune_freed(self) -> None:
        oldest = self._step - self._freed_keep_steps
        freed = self._freed
        expired = []
        for req_id, step in freed.items():  # in the order released
            if step >= oldest:
                break
            expired.append(req_id)
        for req_id in expired:
            del freed[req_id]

    def _count_empty_proposals(
        self,
        spec_tokens: Mapping[str, Sequence[int]],
        num_scheduled_tokens: Mapping[str, int],
        sampled_token_ids: Sequence[Sequence[int]] | None,
        req_id_to_index: Mapping[str, int],
    ) -> int:
        """Decode request-steps that verified one token and no draft.

        A request scheduled for exactly one token, with output tokens from
        earlier steps, is decoding; with no draft scheduled its drafter
        proposed nothing (an ngram miss, for instance). Single-token prefill
        chunks have no output yet and are not counted.
        """
        if not sampled_token_ids:
            return 0
        # C-level passes: requests scheduled for one token and no draft.
        ones = list(compress(num_scheduled_tokens, map(_IS_ONE, num_scheduled_tokens.values())))
        candidates = list(filterfalse(spec_tokens.__contains__, ones)) if spec_tokens else ones
        if not candidates:
            return 0
        requests = self._requests
        found = list(map(requests.get, candidates, repeat(_GONE)))
        generated = list(map(len, map(
            sampled_token_ids.__getitem__, map(req_id_to_index.__getitem__, candidates)
        )))
        if self._finished_above is not None and max(map(_STATUS, found)) <= self._finished_above:
            outputs = list(map(_NUM_OUTPUT_TOKENS, found))
            if 0 not in outputs and 0 not in generated:
                return len(candidates)  # all decoding, all verified one token
        empty = 0
        for request, num_generated in zip(found, generated, strict=True):
            if num_generated and request is not _GONE and is_decoding(request):
                empty += 1
        return empty

    def release(self, request_ids: Collection[str] | None, end_of_step: bool = False) -> None:
        """Finished (or aborted) requests: each tally becomes one acceptance rate.

        ``request_ids`` is one of vLLM's sets of requests freed since a
        schedule; the same id arrives in more than one (see ``_patch``) and
        is counted once: a released request has no tally left.

        ``end_of_step``: after the host's update. Then the step's batch index
        is let go: the host frees it with the step's output, and the last
        reference should not be the plugin's (freeing it costs microseconds).
        """
        scanner = self._scanner
        if scanner is not None:
            scanner.release(request_ids, end_of_step)
        elif request_ids:
            self._release_rows(request_ids)
        if request_ids and self._details is not None:
            self._details.release(request_ids)

    def _release_rows(self, request_ids: Collection[str]) -> None:
        """``release`` over ``RequestTallies`` (no C pass).

        Released ids are kept a few steps: a request in more than one of
        vLLM's sets is counted once.
        """
        freed = self._freed
        new = set(request_ids).difference(freed)
        freed.update(dict.fromkeys(new, self._step))
        totals = self.totals
        for request_id in new:
            drafted, accepted = self._tallies.take(request_id)
            if drafted > 0:
                totals.observe_request(drafted, accepted)

    def steps_by_path(self) -> dict[str, int]:
        """Steps each accounting path took (for tests and benchmarks)."""
        native = self._scanner.native_steps if self._scanner is not None else 0
        return {"native": native, "exact": self._step}

    def held_state(self) -> dict[str, int]:
        """Sizes of what the accountant keeps between steps (for the memory benchmark)."""
        tallies = self._tallies
        scanner = self._scanner
        released = tallies.released if scanner is not None else self._freed
        if scanner is not None:
            spilled = [r for r, detail in scanner.detail_spilled.items() if detail is not None]
            span_details = len(set(scanner.detail_owners).union(spilled))
        else:
            span_details = len(self._details) if self._details is not None else 0
        return {
            "rows": len(scanner.owners) if scanner is not None else 0,
            "tallies_spilled": len(tallies.spilled),
            "released_ids": len(released),
            "span_details": span_details,
            # Finished requests waiting for the span worker (all schedulers').
            "spans_waiting": len(self._handover.items) if self._handover is not None else 0,
        }

    def forget_requests(self) -> None:
        self._tallies.clear()
        self._freed.clear()
        if self._details is not None:
            self._details.clear()


def _add_counts(
    totals: SpecDecodeTotals, hist: list[int], counts: Iterable[tuple[int, int]]
) -> None:
    for value, count in counts:
        if count:
            if value >= len(hist):
                totals.grow(value + 1)
            hist[value] += count
