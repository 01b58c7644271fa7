"""Per-request detail for spans: kept only while request tracing is on.

The metrics need two numbers per request (drafted, accepted: the row
tallies); a span also reports the number of drafts, per-position counts and
when the first draft was verified. This keeps them per request id, fed by
the exact accounting path (tracing turns the vectorised path off), and hands
them over when the request is freed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RequestDetail", "RequestDetails", "tail_sums"]


class RequestDetail:
    """One request's drafts so far, as two histograms of small integers."""

    __slots__ = ("request", "first_ns", "accepted_hist", "drafted_hist")

    def __init__(self, request: Any, first_ns: int, size: int) -> None:
        # vLLM's Request: its trace context and finish reason make the span,
        # which is built after the scheduler has let the request go.
        self.request = request
        self.first_ns = first_ns
        # [a]: drafts that accepted a tokens; [n]: drafts that verified n.
        self.accepted_hist = [0] * size
        self.drafted_hist = [0] * size

    @property
    def drafts(self) -> int:
        return sum(self.accepted_hist)

    @property
    def accepted(self) -> int:
        return sum(a * c for a, c in enumerate(self.accepted_hist))

    @property
    def drafted(self) -> int:
        return sum(n * c for n, c in enumerate(self.drafted_hist))

    def per_position(self, k: int) -> tuple[list[int], list[int]]:
        """(drafted, accepted) tokens at positions 0..k-1."""
        return tail_sums(self.drafted_hist, k), tail_sums(self.accepted_hist, k)


def tail_sums(hist: Sequence[int], k: int) -> list[int]:
    """``out[i]`` = number of entries with value > i, for i in 0..k-1."""
    out = [0] * max(k, len(hist) - 1)
    running = 0
    for value in range(len(hist) - 1, 0, -1):
        running += hist[value]
        out[value - 1] = running
    return out


class RequestDetails:
    """``RequestDetail`` per live request id."""

    __slots__ = ("_size", "_by_id")

    def __init__(self, k: int) -> None:
        self._size = k + 1
        self._by_id: dict[str, RequestDetail] = {}

    def add(self, request: Any, drafted: int, accepted: int, now_ns: int) -> None:
        req_id = request.request_id
        detail = self._by_id.get(req_id)
        if detail is None:
            detail = self._by_id[req_id] = RequestDetail(request, now_ns, self._size)
        top = max(drafted, accepted)
        if top >= len(detail.accepted_hist):
            grow = [0] * (top + 1 - len(detail.accepted_hist))
            detail.accepted_hist.extend(grow)
            detail.drafted_hist.extend(grow)
        detail.accepted_hist[accepted] += 1
        detail.drafted_hist[drafted] += 1

    def take(self, req_id: str) -> RequestDetail | None:
        return self._by_id.pop(req_id, None)

    def drop_missing(self, live: Mapping[str, object]) -> None:
        for req_id in [r for r in self._by_id if r not in live]:
            del self._by_id[req_id]

    def clear(self) -> None:
        self._by_id.clear()

    def __len__(self) -> int:
        return len(self._by_id)
