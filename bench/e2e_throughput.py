"""(c) End to end: output tokens per second of the real engine with the plugin
loaded and not loaded (``VLLM_PLUGINS=""``), alternating runs, median ratio.

Each run is a fresh ``LLM`` (CPU build, tiny model, ngram k = 4, engine core
in its own process as in production) that warms up and then generates
``--prompts`` prompts of ``--max-tokens`` tokens; only the generation is
timed. With the plugin, metrics are exported every 5 s over OTLP/gRPC to a
real receiver on loopback, so export work is part of the run. Runs alternate
(with, without, without, with, ...) so drift affects both alike.

Separate engine processes differ by several percent from one another on a
small shared machine, whatever is loaded. So a second measurement keeps one
engine (in-process) and turns the plugin's patches on and off between
generations (``instrument`` / ``uninstrument``, ABBA order): the same
process, the same memory layout, only the plugin differs.

    .venv/bin/python -m bench.e2e_throughput [--pairs 4] [--rounds 8]
        [--prompts 256] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics

from bench._common import engine_env, run_child, tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    from otel_specdec.demo.receiver import OtlpReceiver

    model = tiny_model()
    config = {"model": model, "mode": "throughput", "prompts": args.prompts,
              "max_tokens": args.max_tokens}
    with_tps: list[float] = []
    without_tps: list[float] = []
    with OtlpReceiver() as receiver:
        endpoint = receiver.endpoint("grpc")
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            for plugin in order:
                r = run_child(config, engine_env(plugin, endpoint))
                (with_tps if plugin else without_tps).append(r["tokens_per_s"])
                print(f"run {pair}: plugin={'on ' if plugin else 'off'} "
                      f"{r['tokens']} tokens in {r['seconds']:.2f} s = "
                      f"{r['tokens_per_s']:.0f} tok/s", flush=True)
        exported = receiver.store.counter_total("vllm.spec_decode.drafts")
        if args.pairs:
            _report("separate processes, VLLM_PLUGINS on/off", with_tps, without_tps)
            print(f"drafts the plugin exported over these runs: {exported:.0f} "
                  "(proves it was loaded)", flush=True)
        toggle = run_child({**config, "mode": "toggle", "rounds": args.rounds},
                           engine_env(True, endpoint, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    rounds = toggle["rounds"]
    _report("one engine, patches toggled",
            [r["tokens_per_s"] for r in rounds if r["plugin"]],
            [r["tokens_per_s"] for r in rounds if not r["plugin"]])


def _report(title: str, with_tps: list[float], without_tps: list[float]) -> None:
    ratios = [w / wo for w, wo in zip(with_tps, without_tps, strict=True)]
    print(f"{title}: median tok/s with plugin {statistics.median(with_tps):.0f}, "
          f"without {statistics.median(without_tps):.0f}; per-pair ratios "
          f"{', '.join(f'{x:.3f}' for x in ratios)}; median ratio "
          f"{statistics.median(ratios):.3f}", flush=True)


if __name__ == "__main__":
    main()
