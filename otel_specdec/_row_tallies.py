"""Per-request accepted/drafted tallies kept by batch row (pure Python).

The fallback for installs without the C accelerator (``_rowscan.Scanner``
keeps the same tallies in C arrays and updates them in its one pass).

A per-request dictionary update costs a dict read and write per request per
step (about 90 ns here, most of the plugin's budget). vLLM's model runner
keeps each running request in the same row of its persistent batch from step
to step, so the tallies are kept in lists indexed by row, and a step adds to
all rows in one C-level ``map``. When a row changes owner (a request
finished, arrived or was moved by the batch's condensing), the previous
owner's tally is moved to a dictionary, so no count is lost; the changed rows
are found in one C-level pass and only they cost Python work.

Two per-step constants are not added row by row: every step subtracts the
one sampled token that is not an accepted draft, and a step in which every
row verified ``k`` drafts adds ``k`` drafted tokens. They are counted once
per step (``steps``, ``full_steps``); a row's columns start from the
counters' values when its owner arrived, so ``accepted = sampled - steps``
and ``drafted = drafted + k * full_steps``.

When most rows change at once (a model runner that does not keep rows
stable), the columns are re-keyed by request in a few C-level passes
instead of row by row.

Plain lists and builtins, not numpy: inside the engine's step, after the
host's own work has evicted numpy's code from the CPU caches, each numpy
call was measured at 5 to 30 µs, more than the whole budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import compress, repeat
from operator import add, ne

__all__ = ["RowTallies"]


class RowTallies:
    """Tallies of the requests in the batch's rows, plus those that left them."""

    __slots__ = ("k", "owners", "sampled", "drafted", "steps", "full_steps", "spilled", "_row_of")

    def __init__(self, k: int) -> None:
        self.k = k
        self.owners: list[str | None] = []
        # Per row: steps-at-arrival + sampled tokens (corrected where the
        # row's step was not a verified draft); -k * full-steps-at-arrival +
        # drafted tokens of the steps that were not full.
        self.sampled: list[int] = []
        self.drafted: list[int] = []
        self.steps = 0
        self.full_steps = 0
        # req_id -> (drafted, accepted) of requests no longer in their row.
        self.spilled: dict[str, tuple[int, int]] = {}
        self._row_of: Mapping[str, int] = {}

    def align(self, rows: list[str], row_of: Mapping[str, int]) -> list[int] | None:
        """Make this step's batch order, ``rows``, the rows' owners.

        Returns the rows whose owner changed (new rows included), or None when
        most did and the columns were re-keyed instead.
        """
        self._row_of = row_of
        owners = self.owners
        if rows == owners:
            return []
        n, m = len(rows), len(owners)
        changed = list(compress(range(min(n, m)), map(ne, rows, owners)))
        if 4 * (len(changed) + abs(n - m)) > n + m:
            self._rekey(rows)
            return None
        for row in changed:
            self._spill_row(row)
            self._reset_row(row)
        for row in range(n, m):  # rows the batch no longer has
            self._spill_row(row)
        del self.sampled[n:], self.drafted[n:]
        if n > m:
            self.sampled.extend(repeat(self.steps, n - m))
            self.drafted.extend(repeat(-self.k * self.full_steps, n - m))
            changed.extend(range(m, n))
        self.owners = list(rows)
        return changed

    def _rekey(self, rows: list[str]) -> None:
        owners = self.owners
        for req_id in set(owners).difference(rows):
            if req_id is not None:
                self._spill_row(owners.index(req_id))
        for name, start in (("sampled", self.steps), ("drafted", -self.k * self.full_steps)):
            by_owner = dict(zip(owners, getattr(self, name), strict=True))
            by_owner.pop(None, None)
            setattr(self, name, list(map(by_owner.get, rows, repeat(start))))
        self.owners = list(rows)

    def add_step(self, sampled: list[int], drafted: list[int] | None) -> None:
        """Add one step: sampled tokens per row, and drafted per row (None: all k)."""
        self.sampled = list(map(add, self.sampled, sampled))
        self.steps += 1
        if drafted is None:
            self.full_steps += 1
        else:
            self.drafted = list(map(add, self.drafted, drafted))

    def correct(self, row: int, sampled: int, drafted: int) -> None:
        """Add to one row's counts (a row whose step was not a verified draft)."""
        self.sampled[row] += sampled
        self.drafted[row] += drafted

    def add_spilled(self, req_id: str, drafted: int, accepted: int) -> None:
        previous = self.spilled.get(req_id)
        if previous is not None:
            drafted += previous[0]
            accepted += previous[1]
        self.spilled[req_id] = (drafted, accepted)

    def take(self, req_id: str) -> tuple[int, int]:
        """Remove and return a request's (drafted, accepted) over its life."""
        drafted, accepted = self.spilled.pop(req_id, (0, 0))
        row = self._find(req_id)
        if row is not None:
            row_drafted, row_accepted = self._row_counts(row)
            drafted += row_drafted
            accepted += row_accepted
            self._reset_row(row)
            self.owners[row] = None
        return drafted, accepted

    def drop_missing(self, live: Mapping[str, object]) -> None:
        """Forget spilled tallies of requests not in ``live`` (never freed)."""
        for req_id in [r for r in self.spilled if r not in live]:
            del self.spilled[req_id]

    def clear(self) -> None:
        self.owners = []
        self.sampled = []
        self.drafted = []
        self.spilled.clear()
        self._row_of = {}

    def _find(self, req_id: str) -> int | None:
        owners = self.owners
        row = self._row_of.get(req_id)
        if row is not None and row < len(owners) and owners[row] == req_id:
            return row
        # The index may be the model runner's live dict, since changed.
        try:
            return owners.index(req_id)
        except ValueError:
            return None

    def _row_counts(self, row: int) -> tuple[int, int]:
        """(drafted, accepted) of the row's owner since it arrived."""
        return self.drafted[row] + self.k * self.full_steps, self.sampled[row] - self.steps

    def _spill_row(self, row: int) -> None:
        owner = self.owners[row]
        if owner is not None:
            drafted, accepted = self._row_counts(row)
            if drafted or accepted:
                self.add_spilled(owner, drafted, accepted)

    def _reset_row(self, row: int) -> None:
        self.sampled[row] = self.steps
        self.drafted[row] = -self.k * self.full_steps
