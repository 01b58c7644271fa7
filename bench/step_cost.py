"""Step cost: vLLM's real ``Scheduler.update_from_output`` with and without
the plugin, side by side in one run.

For each batch size and k, a real scheduler (tiny model config, hand-made
model outputs with a mix of full, partial and zero acceptance) runs steps;
even steps call the wrapped method (plugin accounting on), odd steps call
the unwrapped original (``__wrapped__``), so both see the same kind of
steps under the same machine noise. Reported: median time per step of each,
the plugin's added time, and that as a percentage of the unwrapped call.

    .venv/bin/python bench/step_cost.py [--batches 1,64,256,1024] [--ks 1,4,8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def measure(model_dir: str, batch: int, k: int, steps: int) -> tuple[float, float]:
    from scheduler_harness import SchedulerHarness, build_scheduler

    harness = SchedulerHarness(build_scheduler(model_dir, k, log_stats=False,
                                               max_num_seqs=max(batch, 1)))
    harness.add_requests(batch, max_tokens=10_000)
    drafts = list(range(20, 20 + k))

    def accept(req_id: str, d: list[int]) -> int:
        # full, partial and zero acceptance, varying by request and step
        return (hash(req_id) + harness_step[0]) % (len(d) + 1)

    harness_step = [0]
    harness.step(accept, lambda r: drafts)  # prefill
    update = type(harness.scheduler).update_from_output
    original = update.__wrapped__
    wrapped_times: list[float] = []
    plain_times: list[float] = []
    for step in range(2 * steps):
        harness_step[0] = step
        so = harness.schedule()
        mro = harness.model_output(so, accept)
        t0 = time.perf_counter()
        if step % 2 == 0:
            harness.scheduler.update_from_output(so, mro)
            wrapped_times.append(time.perf_counter() - t0)
        else:
            original(harness.scheduler, so, mro)
            plain_times.append(time.perf_counter() - t0)
        harness.propose(so, lambda r: drafts)
    return statistics.median(wrapped_times), statistics.median(plain_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,64,256,1024")
    parser.add_argument("--ks", default="1,4,8")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    import logging

    logging.disable(logging.WARNING)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_specdec import SpecDecodeInstrumentor
    from otel_specdec._tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(Path(tempfile.mkdtemp()) / "target"))
    SpecDecodeInstrumentor().instrument(
        meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]))
    print(f"{'batch':>6} {'k':>3} {'unwrapped µs':>13} {'with plugin µs':>15} "
          f"{'added µs':>9} {'added %':>8}")
    for batch in [int(b) for b in args.batches.split(",")]:
        for k in [int(x) for x in args.ks.split(",")]:
            wrapped, plain = measure(model_dir, batch, k, args.steps)
            added = wrapped - plain
            print(f"{batch:>6} {k:>3} {plain * 1e6:>13.1f} {wrapped * 1e6:>15.1f} "
                  f"{added * 1e6:>9.1f} {100 * added / plain:>7.1f}%", flush=True)


if __name__ == "__main__":
    main()
