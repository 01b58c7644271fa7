"""(b) Export cost: CPU time of one collection/export cycle as a function of
the number of drafts recorded since the previous cycle.

The plugin's own runtime is built as in an engine process (its meter
provider, OTLP/gRPC exporter and metric reader, from the usual environment
variables) and exports to a real OTLP receiver on loopback. Drafts are
recorded through the plugin's step accountant (synthetic steps of 1024
requests, k = 4, acceptance varying over 0..k); then one cycle
(``force_flush``: collect, build the histogram points, encode, send) is timed
in CPU time of the calling thread, which is where the SDK does that work.

    .venv/bin/python -m bench.export_cost [--drafts 0,1000,100000,1000000] [--cycles 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

BATCH = 1024
K = 4


def _synthetic_step(step: int) -> tuple:
    rows = [f"req-{i}" for i in range(BATCH)]
    spec = {r: [20 + j for j in range(K)] for r in rows}
    sampled = [[7] * (1 + (i + step) % (K + 1)) for i in range(BATCH)]
    return spec, {r: K + 1 for r in rows}, sampled, {r: i for i, r in enumerate(rows)}, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafts", default="0,1000,10000,100000,1000000")
    parser.add_argument("--cycles", type=int, default=15)
    args = parser.parse_args()

    from otel_specdec import _runtime
    from otel_specdec._vllm_compat import EngineInfo
    from otel_specdec.demo.receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    os.environ.update({
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint("grpc"),
        "OTEL_METRIC_EXPORT_INTERVAL": str(3_600_000),  # cycles run only when called
    })
    info = EngineInfo(model="bench-model", method="ngram", num_speculative_tokens=K,
                      data_parallel_rank=0, num_sampled_per_step=1,
                      async_scheduling=False, steps_in_flight=0)
    runtime = _runtime.get_or_create(info)
    assert runtime is not None, "the plugin's runtime did not start"
    requests = {f"req-{i}": SimpleNamespace(status=2, num_output_tokens=1)
                for i in range(BATCH)}
    accountant = runtime.accountant_for(SimpleNamespace(requests=requests), info)
    steps = [_synthetic_step(s) for s in range(K + 1)]

    def cycle() -> float:
        t0 = time.thread_time()
        runtime.provider.force_flush()
        return time.thread_time() - t0

    accountant.observe_step(*steps[0][:4])
    cycle()  # first export: connection set-up, and every series exists from here on
    print(f"{'drafts/cycle':>13} {'CPU ms/cycle':>13} {'min':>7} {'max':>7}")
    for drafts in [int(d) for d in args.drafts.split(",")]:
        times = []
        for c in range(args.cycles):
            for s in range(drafts // BATCH):
                accountant.observe_step(*steps[(s + c) % len(steps)][:4])
            times.append(cycle())
        print(f"{drafts:>13} {statistics.median(times) * 1e3:>13.2f} "
              f"{min(times) * 1e3:>7.2f} {max(times) * 1e3:>7.2f}", flush=True)
    total = receiver.store.counter_total("vllm.spec_decode.drafts")
    recorded = sum(accountant.totals.accepted_hist)
    print(f"receiver's drafts total {total} == recorded {recorded}: {total == recorded}")
    runtime.close()
    receiver.stop()


if __name__ == "__main__":
    main()
