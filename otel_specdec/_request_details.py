"""Per-request detail for request spans, and its hand-over to the span worker.

The metrics need two numbers per request (drafted, accepted: the row
tallies). A span also reports the request's drafts by accepted length and
by drafted length (from which follow its drafts, tokens, per-position counts
and acceptance-length histogram) and the time of its first verified draft.
That detail is kept where the counts are: by the C pass in its rows (see
``_rowscan.c``, "Request detail"), or here, by request id, where the C pass
was not built. Only requests whose span can be sampled keep it (the
sampling plan, ``_span_sampling``).

``DetailHandover`` is the one place for what is decided once per request,
on both paths: which requests keep detail (``decide``, the sampling plan,
which reads the trace context) and the hand-over of finished requests'
detail (``hand_over``: a bounded list, the drops and their warning). A
finished request's detail is one tuple, ``(totals, trace_headers, status,
first_ns, end_ns, packed_counts)`` (``pack_counts``: one bytes object),
built where its counts are (by the C pass, which passes each call's
tuples in one ``hand_over`` call, or by ``RequestDetails.release``),
appended on the scheduler's thread and taken by the span worker thread.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from otel_specdec._span_sampling import SamplingPlan

__all__ = ["DetailHandover", "RequestDetails", "pack_counts", "tail_sums", "unpack_counts"]

_logger = logging.getLogger(__name__)


def tail_sums(hist: Sequence[int], k: int) -> list[int]:
    """``out[i]`` = number of entries with value > i, for i in 0..k-1."""
    out = [0] * max(k, len(hist) - 1)
    running = 0
    for value in range(len(hist) - 1, 0, -1):
        running += hist[value]
        out[value - 1] = running
    return out


def pack_counts(accepted: Sequence[int], drafted: Sequence[int]) -> bytes:
    """A request's counts as handed over: n accepted-length counts, then n
    drafted-length counts, native 64-bit integers (the C pass's layout)."""
    return array("q", [*accepted, *drafted]).tobytes()


def unpack_counts(packed: bytes) -> tuple[list[int], list[int]]:
    """(accepted-length counts, drafted-length counts) from ``pack_counts``."""
    counts = memoryview(packed).cast("q").tolist()
    half = len(counts) // 2
    return counts[:half], counts[half:]


class DetailHandover:
    """Which requests keep detail, and finished requests' detail, from the
    scheduler's thread to the span worker.

    Appends and takes are single list operations under the GIL; the worker
    takes what is there and leaves what is appended meanwhile.
    """

    __slots__ = ("items", "limit", "plan", "_said")

    def __init__(self, plan: SamplingPlan, limit: int) -> None:
        self.items: list[tuple[Any, ...]] = []
        self.limit = limit
        self.plan = plan
        self._said = False

    def decide(self, requests: Sequence[Any]) -> list[bool]:
        """For each request, whether the plan keeps its detail (by its trace
        context): the C pass calls this once per step, about the requests
        the step first schedules."""
        plan = self.plan
        if plan.keeps_all():
            return [True] * len(requests)
        keeps, root = plan.keeps, plan.root
        return [root if (headers := getattr(request, "trace_headers", None)) is None
                else keeps(headers) for request in requests]

    def hand_over(self, released: list[tuple[Any, ...]]) -> None:
        """Finished requests' detail, appended for the span worker while
        there is room (no per-request work here: the C pass calls this once
        per call)."""
        items = self.items
        room = self.limit - len(items)
        if room >= len(released):
            items.extend(released)
            return
        if room > 0:
            items.extend(released[:room])
        self._note_drop()

    def _note_drop(self) -> None:
        """Details did not fit: said once per process."""
        if not self._said:
            self._said = True
            _logger.warning("otel_specdec: more than %d finished requests wait for their span; "
                            "their spans are dropped until the backlog clears (metrics are "
                            "unaffected)", self.limit)

    def take(self) -> list[tuple[Any, ...]]:
        items = self.items
        count = len(items)
        taken = items[:count]
        del items[:count]
        return taken


class _Detail:
    __slots__ = ("request", "first_ns", "accepted", "drafted")

    def __init__(self, request: Any, first_ns: int, size: int) -> None:
        self.request = request
        self.first_ns = first_ns
        self.accepted = [0] * size
        self.drafted = [0] * size


class RequestDetails:
    """Request detail by request id (where the C pass was not built).

    ``None`` marks a live request the plan keeps no detail for (decided on
    its first draft, not again each step).
    """

    __slots__ = ("_size", "_by_id", "_handover", "_totals")

    def __init__(self, totals: Any, handover: DetailHandover) -> None:
        self._size = totals.num_speculative_tokens + 1
        self._totals = totals
        self._handover = handover
        self._by_id: dict[str, _Detail | None] = {}

    def add(self, req_id: str, request: Any, drafted: int, accepted: int, now_ns: int) -> None:
        by_id = self._by_id
        detail = by_id.get(req_id, False)
        if detail is False:
            keep = self._handover.plan.keeps(getattr(request, "trace_headers", None))
            detail = by_id[req_id] = _Detail(request, now_ns, self._size) if keep else None
        if detail is None:
            return
        top = max(drafted, accepted)
        if top >= len(detail.accepted):
            grow = [0] * (top + 1 - len(detail.accepted))
            detail.accepted.extend(grow)
            detail.drafted.extend(grow)
        detail.accepted[accepted] += 1
        detail.drafted[drafted] += 1

    def release(self, request_ids: Iterable[str]) -> None:
        """Finished requests: their detail goes to the span worker."""
        by_id = self._by_id
        released = []
        for req_id in request_ids:
            detail = by_id.pop(req_id, None)
            if detail is not None and any(detail.accepted):
                request = detail.request
                released.append((
                    self._totals, getattr(request, "trace_headers", None),
                    getattr(request, "status", None), detail.first_ns, time.time_ns(),
                    pack_counts(detail.accepted, detail.drafted)))
        if released:
            self._handover.hand_over(released)

    def drop_missing(self, live: Mapping[str, object]) -> None:
        for req_id in [r for r in self._by_id if r not in live]:
            del self._by_id[req_id]

    def clear(self) -> None:
        self._by_id.clear()

    def __len__(self) -> int:
        return sum(1 for detail in self._by_id.values() if detail is not None)
