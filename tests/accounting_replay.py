"""A seeded stream of engine steps, accounted by the C pass and by the exact
path; prints one JSON line with both totals and an expectation computed
here from the stream itself.

Runs without vLLM and without pytest (``python tests/accounting_replay.py``),
so that a wheel's C pass can be checked by any Python that can import it:
the aarch64 wheel's under ``qemu-aarch64`` (tests/test_dist.py). The steps
are plain objects with the fields the running vLLM's layout names
(``_vllm_compat.STEP_FIELDS``): rows in batch order, drafts of 0..k tokens,
an accepted prefix of random length, requests that finish and leave their
rows to new ones.
"""

from __future__ import annotations

import json
import platform
import random
import sys
import types
from typing import Any

from otel_specdec import _accounting
from otel_specdec._totals import EMPTY_PROPOSALS, SpecDecodeTotals
from otel_specdec._vllm_compat import STEP_FIELDS

K = 4
BATCH = 48
STEPS = 400
RUNNING = 2


class _Request:
    """The fields of vLLM's Request the accounting reads."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.status = RUNNING
        self.num_output_tokens = 1

    def is_finished(self) -> bool:
        return self.status > RUNNING


def _stream(seed: int) -> list[tuple[Any, Any, set[str]]]:
    """(scheduler output, model runner output, requests finished in it) per step."""
    rng = random.Random(seed)
    live: dict[str, int] = {}  # req_id -> steps left
    next_id = 0
    steps = []
    for _ in range(STEPS):
        while len(live) < BATCH:
            live[f"req-{next_id}"] = rng.randint(2, 30)
            next_id += 1
        spec: dict[str, list[int]] = {}
        scheduled: dict[str, int] = {}
        sampled: list[list[int]] = []
        rows = list(live)
        for req_id in rows:
            drafts = [rng.randrange(50_000) for _ in range(rng.randint(0, K))]
            if drafts:
                spec[req_id] = drafts
            scheduled[req_id] = 1 + len(drafts)
            sampled.append([rng.randrange(50_000) for _ in range(rng.randint(1, len(drafts) + 1))])
        finished = set()
        for req_id in rows:
            live[req_id] -= 1
            if live[req_id] == 0:
                finished.add(req_id)
                del live[req_id]
        scheduler_output = types.SimpleNamespace(**{
            STEP_FIELDS.spec_tokens: spec, STEP_FIELDS.num_scheduled: scheduled,
            STEP_FIELDS.invalid_spec_tokens: None, STEP_FIELDS.finished_ids: set()})
        runner_output = types.SimpleNamespace(**{
            STEP_FIELDS.sampled: sampled, STEP_FIELDS.rows: rows,
            STEP_FIELDS.row_of: {r: i for i, r in enumerate(rows)},
            STEP_FIELDS.kv_output: None})
        steps.append((scheduler_output, runner_output, finished))
    return steps


def _expected(steps: list[tuple[Any, Any, set[str]]]) -> dict[str, Any]:
    """vLLM's rules applied to the stream directly: every row with drafts is
    verified; accepted = sampled - 1."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": [0] * K}
    for scheduler_output, runner_output, _ in steps:
        spec = getattr(scheduler_output, STEP_FIELDS.spec_tokens)
        rows = getattr(runner_output, STEP_FIELDS.rows)
        sampled = getattr(runner_output, STEP_FIELDS.sampled)
        for row, req_id in enumerate(rows):
            drafts = spec.get(req_id)
            if not drafts:
                continue
            accepted = len(sampled[row]) - 1
            out["drafts"] += 1
            out["draft_tokens"] += len(drafts)
            out["accepted_tokens"] += accepted
            for position in range(accepted):
                out["accepted_per_pos"][position] += 1
    return out


def _account(steps: list[tuple[Any, Any, set[str]]], native: bool) -> dict[str, Any]:
    totals = SpecDecodeTotals({}, K)
    requests: dict[str, Any] = {}
    # A table that is not a dict keeps the C pass out (see StepAccountant).
    table: Any = requests if native else types.MappingProxyType(requests)
    accountant = _accounting.StepAccountant(totals, table, steps_in_flight=0,
                                            finished_above=RUNNING)
    for scheduler_output, runner_output, finished in steps:
        for req_id in getattr(runner_output, STEP_FIELDS.rows):
            requests.setdefault(req_id, _Request(req_id))
        accountant.account_step(scheduler_output, runner_output, None)
        accountant.end_step(finished)
        for req_id in finished:
            del requests[req_id]
    snapshot = totals.snapshot()
    return {
        "drafts": sum(snapshot.accepted_hist),
        "draft_tokens": sum(n * c for n, c in enumerate(snapshot.drafted_hist)),
        "accepted_tokens": sum(a * c for a, c in enumerate(snapshot.accepted_hist)),
        "accepted_per_pos": snapshot.accepted_per_position(K),
        "empty_proposals": totals.step_counts[EMPTY_PROPOSALS],
        "rate_buckets": snapshot.rate_buckets,
        "rate_sum": round(snapshot.rate_sum, 9),
        "paths": accountant.steps_by_path(),
    }


def main() -> None:
    steps = _stream(seed=int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    scanner = _accounting.NATIVE_SCANNER
    print(json.dumps({
        "machine": platform.machine(),
        "c_pass": sys.modules[scanner.__module__].__file__ if scanner else None,
        "expected": _expected(steps),
        "c": _account(steps, native=True) if scanner else None,
        "exact": _account(steps, native=False),
    }))


if __name__ == "__main__":
    main()
