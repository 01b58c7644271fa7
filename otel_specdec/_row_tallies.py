"""Per-request accepted/drafted tallies kept by batch row.

A per-request dictionary update costs a dict read and write per request per
step (about 90 ns here, most of the plugin's budget). vLLM's model runner
keeps each running request in the same row of its persistent batch from step
to step, so the tallies are kept in arrays indexed by row and a step adds to
all rows at once. When a row changes owner (a request finished, arrived or
was moved by the batch's condensing), the previous owner's tally is moved to
a dictionary, so no count is lost; the changed rows are found in one C-level
pass and only they cost Python work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress
from operator import ne

import numpy as np

__all__ = ["RowTallies"]


class RowTallies:
    """Tallies of the requests in the batch's rows, plus those that left them."""

    __slots__ = ("owners", "accepted", "drafted", "spilled", "_row_of")

    def __init__(self) -> None:
        self.owners: list[str | None] = []
        self.accepted = np.zeros(0, np.int64)
        self.drafted = np.zeros(0, np.int64)
        # req_id -> (drafted, accepted) of requests no longer in their row.
        self.spilled: dict[str, tuple[int, int]] = {}
        self._row_of: Mapping[str, int] = {}

    def align(self, rows: Sequence[str], row_of: Mapping[str, int]) -> None:
        """Make the rows' owners ``rows`` (this step's batch order)."""
        owners = self.owners
        if not isinstance(rows, list):
            rows = list(rows)
        if rows == owners:
            self._row_of = row_of
            return
        n, m = len(rows), len(owners)
        if n > len(self.accepted):
            self._grow(n)
        changed = list(compress(range(min(n, m)), map(ne, rows, owners)))
        changed.extend(range(n, m))  # rows the batch no longer has
        changed.extend(range(m, n))  # new rows (nothing to spill)
        accepted, drafted = self.accepted, self.drafted
        for row in changed:
            owner = owners[row] if row < m else None
            if owner is not None and (drafted[row] or accepted[row]):
                self.add_spilled(owner, int(drafted[row]), int(accepted[row]))
            accepted[row] = 0
            drafted[row] = 0
        self.owners = list(rows)
        self._row_of = row_of

    def add_spilled(self, req_id: str, drafted: int, accepted: int) -> None:
        previous = self.spilled.get(req_id)
        if previous is not None:
            drafted += previous[0]
            accepted += previous[1]
        self.spilled[req_id] = (drafted, accepted)

    def take(self, req_id: str) -> tuple[int, int]:
        """Remove and return a request's (drafted, accepted) over its life."""
        drafted, accepted = self.spilled.pop(req_id, (0, 0))
        owners = self.owners
        row = self._row_of.get(req_id)
        if row is None or row >= len(owners) or owners[row] != req_id:
            # The index may be the model runner's live dict: find the row.
            try:
                row = owners.index(req_id)
            except ValueError:
                row = None
        if row is not None:
            drafted += int(self.drafted[row])
            accepted += int(self.accepted[row])
            self.drafted[row] = 0
            self.accepted[row] = 0
            self.owners[row] = None
        return drafted, accepted

    def drop_missing(self, live: object) -> None:
        """Forget spilled tallies of requests not in ``live`` (never freed)."""
        for req_id in [r for r in self.spilled if r not in live]:  # type: ignore[operator]
            del self.spilled[req_id]

    def clear(self) -> None:
        self.owners = []
        self.accepted[:] = 0
        self.drafted[:] = 0
        self.spilled.clear()
        self._row_of = {}

    def _grow(self, n: int) -> None:
        size = max(n, 2 * len(self.accepted), 64)
        for name in ("accepted", "drafted"):
            old = getattr(self, name)
            new = np.zeros(size, np.int64)
            new[: len(old)] = old
            setattr(self, name, new)
