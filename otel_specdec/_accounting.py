"""Speculative-decoding accounting, identical to vLLM's own, on plain data.

This is the hot path: ``StepAccountant.observe_step`` runs inside the
engine's ``Scheduler.update_from_output`` for every step. It makes no
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

import bisect
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from otel_specdec._instruments import REQUEST_RATE_BOUNDS

__all__ = ["SpecDecodeTotals", "StepAccountant", "TotalsSnapshot"]

Attributes = Mapping[str, Any]

# A request's accepted-token count fits below bit 32 (4 billion tokens).
_TALLY_SHIFT = 32
_TALLY_MASK = (1 << _TALLY_SHIFT) - 1


class TotalsSnapshot(NamedTuple):
    """A consistent copy of one totals entry, taken at collection time."""

    accepted_hist: list[int]
    drafted_hist: list[int]
    empty_proposals: int
    padding_tokens: int
    rate_buckets: list[int]
    rate_sum: float

    def accepted_per_position(self, k: int) -> list[int]:
        return _tail_sums(self.accepted_hist, k)

    def drafted_per_position(self, k: int) -> list[int]:
        return _tail_sums(self.drafted_hist, k)


def _tail_sums(hist: Sequence[int], k: int) -> list[int]:
    """``out[i]`` = number of entries with value > i, for i in 0..k-1."""
    out = [0] * max(k, len(hist) - 1)
    running = 0
    for value in range(len(hist) - 1, 0, -1):
        running += hist[value]
        out[value - 1] = running
    return out


class SpecDecodeTotals:
    """Process-lifetime cumulative totals for one attribute set.

    Several schedulers with the same model, method and k (an engine
    re-created in the same process) share one entry, so the exported
    counters stay monotonic.
    """

    __slots__ = (
        "attributes",
        "num_speculative_tokens",
        "accepted_hist",
        "drafted_hist",
        "empty_proposals",
        "padding_tokens",
        "rate_buckets",
        "rate_sum",
        "rate_trackers",
        "start_time_ns",
    )

    def __init__(self, attributes: Attributes, num_speculative_tokens: int) -> None:
        self.attributes = dict(attributes)
        self.num_speculative_tokens = num_speculative_tokens
        self.accepted_hist = [0] * (num_speculative_tokens + 1)
        self.drafted_hist = [0] * (num_speculative_tokens + 1)
        self.empty_proposals = 0
        self.padding_tokens = 0
        # One bucket per explicit bound plus the overflow bucket.
        self.rate_buckets = [0] * (len(REQUEST_RATE_BOUNDS) + 1)
        self.rate_sum = 0.0
        # Per-reader running min/max of request rates since that reader's
        # last collection (min/max cannot be derived from buckets).
        self.rate_trackers: dict[int, list[float]] = {}
        self.start_time_ns = time.time_ns()

    def grow(self, size: int) -> None:
        """Make the histograms hold values up to ``size - 1`` (dynamic k)."""
        for hist in (self.accepted_hist, self.drafted_hist):
            if len(hist) < size:
                hist.extend([0] * (size - len(hist)))

    def observe_request(self, drafted: int, accepted: int) -> None:
        rate = accepted / drafted
        self.rate_buckets[bisect.bisect_left(REQUEST_RATE_BOUNDS, rate)] += 1
        self.rate_sum += rate
        for tracker in self.rate_trackers.values():
            if rate < tracker[0]:
                tracker[0] = rate
            if rate > tracker[1]:
                tracker[1] = rate

    def snapshot(self) -> TotalsSnapshot:
        return TotalsSnapshot(
            list(self.accepted_hist),
            list(self.drafted_hist),
            self.empty_proposals,
            self.padding_tokens,
            list(self.rate_buckets),
            self.rate_sum,
        )


class StepAccountant:
    """Per-scheduler accounting: feeds one ``SpecDecodeTotals`` each step."""

    __slots__ = (
        "totals",
        "_requests",
        "_tallies",
        "_num_sampled",
        "_track_padding",
        "_check_stale",
        "_finished_above",
    )

    def __init__(
        self,
        totals: SpecDecodeTotals,
        requests: Mapping[str, Any],
        *,
        num_sampled_per_step: int = 1,
        track_padding: bool = True,
        finished_above: int | None = None,
    ) -> None:
        self.totals = totals
        self._requests = requests
        # req_id -> drafted << 32 | accepted over the request's life so far
        # (one int: one dict read and one write per request per step).
        self._tallies: dict[str, int] = {}
        self._num_sampled = num_sampled_per_step
        # Under async scheduling every scheduled draft is a -1 placeholder,
        # so padding cannot be told apart there.
        self._track_padding = track_padding
        self._check_stale: bool | None = None
        # Statuses above this are finished (see _vllm_compat); None: ask the request.
        self._finished_above = finished_above

    def observe_step(
        self,
        spec_tokens: Mapping[str, Sequence[int]],
        num_scheduled_tokens: Mapping[str, int],
        sampled_token_ids: Sequence[Sequence[int]] | None,
        req_id_to_index: Mapping[str, int],
        invalid_spec_tokens: Mapping[str, int] | None = None,
        skip_ids: Iterable[str] | None = None,
    ) -> None:
        """Account one scheduler step, from the step's inputs only."""
        requests = self._requests
        if self._check_stale is None and requests:
            self._check_stale = hasattr(
                next(iter(requests.values())), "num_stale_output_tokens"
            )
        check_stale = self._check_stale
        skip = set(skip_ids) if skip_ids else None
        totals = self.totals
        accepted_hist = totals.accepted_hist
        drafted_hist = totals.drafted_hist
        tallies = self._tallies
        num_sampled = self._num_sampled
        track_padding = self._track_padding
        finished_above = self._finished_above
        padding = 0

        for req_id, drafts in spec_tokens.items():
            if not drafts:
                continue
            request = requests.get(req_id)
            if request is None:
                continue
            if finished_above is None:
                if request.is_finished():
                    continue
            elif request.status > finished_above:
                continue
            if skip is not None and req_id in skip:
                continue
            if (
                check_stale
                and request.num_stale_output_tokens > 0
                and request.drop_stale_output
            ):
                continue
            generated = sampled_token_ids[req_id_to_index[req_id]] if sampled_token_ids else ()
            if not generated and num_sampled:
                continue
            num_drafted = len(drafts)
            num_accepted = len(generated) - num_sampled
            if num_accepted < 0:
                num_accepted = 0
            elif num_accepted > num_drafted:
                num_accepted = num_drafted
            invalid = invalid_spec_tokens.get(req_id, 0) if invalid_spec_tokens else 0
            if track_padding and drafts[-1] < 0:
                padding += drafts.count(-1) - invalid
            num_drafted -= invalid
            try:
                accepted_hist[num_accepted] += 1
                drafted_hist[num_drafted] += 1
            except IndexError:
                totals.grow(max(num_accepted, num_drafted) + 1)
                accepted_hist[num_accepted] += 1
                drafted_hist[num_drafted] += 1
            tallies[req_id] = tallies.get(req_id, 0) + (num_drafted << _TALLY_SHIFT | num_accepted)

        if padding:
            totals.padding_tokens += padding
        empty = self._count_empty_proposals(
            spec_tokens, num_scheduled_tokens, sampled_token_ids, req_id_to_index
        )
        if empty:
            totals.empty_proposals += empty

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
        if not sampled_token_ids or not list(num_scheduled_tokens.values()).count(1):
            return 0
        requests = self._requests
        empty = 0
        for req_id in [r for r, n in num_scheduled_tokens.items() if n == 1]:
            if req_id in spec_tokens:
                continue
            request = requests.get(req_id)
            if request is None or request.is_finished() or not request.num_output_tokens:
                continue
            if sampled_token_ids[req_id_to_index[req_id]]:
                empty += 1
        return empty

    def observe_freed(self, request_id: str) -> None:
        """Record a finished (or aborted) request's acceptance rate."""
        tally = self._tallies.pop(request_id, 0)
        drafted, accepted = tally >> _TALLY_SHIFT, tally & _TALLY_MASK
        if drafted > 0:
            self.totals.observe_request(drafted, accepted)

    def forget_requests(self) -> None:
        self._tallies.clear()
