"""The process's cumulative totals: what the accounting writes each step
and the exporter reads at collection time.

One ``SpecDecodeTotals`` per attribute set (model, method, k), kept in the
process's ``TotalsRegistry``. The accounting (``_accounting``, and the C
pass, which adds to the same Python lists in place) only adds to them; the
exporter (``_metrics_export``) takes a ``TotalsSnapshot`` of each.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from otel_specdec._instruments import REQUEST_RATE_BOUNDS
from otel_specdec._request_details import tail_sums

__all__ = [
    "EMPTY_PROPOSALS", "PADDING_TOKENS", "STEP_COUNTS", "SpecDecodeTotals", "TotalsRegistry",
    "TotalsSnapshot",
]

Attributes = Mapping[str, Any]

# The slots of SpecDecodeTotals.step_counts, in order. The C pass is given
# these names and checks them against its own.
STEP_COUNTS = ("empty_proposals", "padding_tokens")
EMPTY_PROPOSALS = STEP_COUNTS.index("empty_proposals")
PADDING_TOKENS = STEP_COUNTS.index("padding_tokens")


class TotalsSnapshot(NamedTuple):
    """A consistent copy of one totals entry, taken at collection time."""

    accepted_hist: list[int]
    drafted_hist: list[int]
    empty_proposals: int
    padding_tokens: int
    rate_buckets: list[int]
    rate_sum: float

    def accepted_per_position(self, k: int) -> list[int]:
        return tail_sums(self.accepted_hist, k)

    def drafted_per_position(self, k: int) -> list[int]:
        return tail_sums(self.drafted_hist, k)


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
        "step_counts",
        "rate_buckets",
        "rate_sum_cell",
        "rate_trackers",
        "rate_exemplars",
        "start_time_ns",
    )

    def __init__(self, attributes: Attributes, num_speculative_tokens: int) -> None:
        self.attributes = dict(attributes)
        self.num_speculative_tokens = num_speculative_tokens
        self.accepted_hist = [0] * (num_speculative_tokens + 1)
        self.drafted_hist = [0] * (num_speculative_tokens + 1)
        # [empty proposals, padding tokens]. The counts and the rate sum are
        # kept in lists, like the histograms, so that the C pass adds to them
        # in place.
        self.step_counts = [0, 0]
        # One bucket per explicit bound plus the overflow bucket.
        self.rate_buckets = [0] * (len(REQUEST_RATE_BOUNDS) + 1)
        self.rate_sum_cell = [0.0]
        # Per-reader running min/max of request rates since that reader's
        # last collection (min/max cannot be derived from buckets).
        self.rate_trackers: dict[int, list[float]] = {}
        # Per rate bucket, the latest sampled request span that landed there:
        # (rate, time_ns, trace_id, span_id). Written by the span emitter.
        self.rate_exemplars: list[tuple[float, int, int, int] | None] = (
            [None] * len(self.rate_buckets)
        )
        self.start_time_ns = time.time_ns()

    @property
    def empty_proposals(self) -> int:
        return self.step_counts[EMPTY_PROPOSALS]

    @property
    def padding_tokens(self) -> int:
        return self.step_counts[PADDING_TOKENS]

    @property
    def rate_sum(self) -> float:
        return self.rate_sum_cell[0]

    def grow(self, size: int) -> None:
        """Make the histograms hold values up to ``size - 1`` (dynamic k)."""
        for hist in (self.accepted_hist, self.drafted_hist):
            if len(hist) < size:
                hist.extend([0] * (size - len(hist)))

    def observe_request(self, drafted: int, accepted: int) -> None:
        """One finished request's acceptance rate (the C pass does the same in C)."""
        rate = accepted / drafted
        self.rate_buckets[bisect.bisect_left(REQUEST_RATE_BOUNDS, rate)] += 1
        self.rate_sum_cell[0] += rate
        for tracker in self.rate_trackers.values():
            if rate < tracker[0]:
                tracker[0] = rate
            if rate > tracker[1]:
                tracker[1] = rate

    def record_exemplar(self, rate: float, time_ns: int, trace_id: int, span_id: int) -> None:
        """Link ``rate``'s bucket to the request span that produced it."""
        self.rate_exemplars[bisect.bisect_left(REQUEST_RATE_BOUNDS, rate)] = (
            rate, time_ns, trace_id, span_id
        )

    def snapshot(self) -> TotalsSnapshot:
        return TotalsSnapshot(
            list(self.accepted_hist),
            list(self.drafted_hist),
            *self.step_counts,
            list(self.rate_buckets),
            self.rate_sum_cell[0],
        )


class TotalsRegistry:
    """All totals entries of this process, one per attribute set."""

    def __init__(self) -> None:
        self._entries: dict[tuple[tuple[str, Any], ...], SpecDecodeTotals] = {}
        self._tracker_keys: list[int] = []
        self._lock = threading.Lock()
        self.pid = os.getpid()

    def totals_for(self, attributes: dict[str, Any], k: int) -> SpecDecodeTotals:
        key = tuple(sorted(attributes.items()))
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = SpecDecodeTotals(attributes, k)
                for tracker_key in self._tracker_keys:
                    entry.rate_trackers[tracker_key] = [float("inf"), float("-inf")]
            return entry

    def add_rate_tracker(self, key: int) -> None:
        """Track request-rate min/max for one reader from now on."""
        with self._lock:
            self._tracker_keys.append(key)
            for entry in self._entries.values():
                entry.rate_trackers[key] = [float("inf"), float("-inf")]

    def data_points(self) -> int:
        """How many data points one collection of these totals exports."""
        # Per series: drafts, empty proposals, padding and the two
        # histograms, plus drafted and accepted tokens at each position.
        return sum(5 + 2 * entry.num_speculative_tokens for entry in self.entries())

    def entries(self) -> list[SpecDecodeTotals]:
        # A forked child must not report its parent's totals.
        if os.getpid() != self.pid:
            return []
        with self._lock:
            return list(self._entries.values())


