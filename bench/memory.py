"""(d) Memory: resident memory of the engine process over a long run, in
every mode the plugin can run in, and the plugin's held state after each wave.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
the plugin's structures can be inspected. It generates ``--waves`` waves of
``--prompts`` requests; resident memory and the plugin's held state (rows,
tallies of requests that left their row, remembered released ids, span
details) are read after each wave. Modes: no plugin; the C pass; the
exact path only (pure Python, as where the C pass was not built); each
with request spans on (every request sampled, exported to a receiver).
Held state must stay bounded by the batch, not grow with the requests.

    .venv/bin/python -m bench.memory [--waves 10] [--prompts 256] [--max-tokens 32]
                                     [--modes off,native,native+spans,...]
"""

from __future__ import annotations

import argparse

from bench._common import engine_env, run_child, tiny_model

MIB = 1024 * 1024


MODES = ("off", "native", "native+spans", "exact", "exact+spans")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waves", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()

    from otel_specdec.demo.receiver import OtlpReceiver

    model = tiny_model()
    with OtlpReceiver() as receiver:
        endpoint = receiver.endpoint("grpc")
        for mode in args.modes.split(","):
            accounting, _, spans = mode.partition("+")
            config = {"model": model, "mode": "memory", "prompts": args.prompts,
                      "max_tokens": args.max_tokens, "waves": args.waves,
                      "accounting": "native" if accounting == "off" else accounting}
            extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            if spans:
                extra.update(OTEL_SPECDEC_TRACES="true", OTEL_TRACES_EXPORTER="otlp")
            r = run_child(config, engine_env(accounting != "off", endpoint, **extra))
            rss = [b / MIB for b in r["rss_bytes"]]
            print(f"{mode:>18}: RSS after wave 1 {rss[0]:.1f} MiB, after wave {len(rss)} "
                  f"({len(rss)}x the requests) {rss[-1]:.1f} MiB, growth "
                  f"{rss[-1] - rss[0]:+.1f} MiB", flush=True)
            states = r.get("plugin_states") or []
            if states and states[0].get("accountant"):
                keys = [k for k in states[0] if k not in ("accountant", "live_requests")]
                for key in keys:
                    print(f"{'':>20}{key}: " + " ".join(str(s[key]) for s in states),
                          flush=True)


if __name__ == "__main__":
    main()
