"""(d) Memory: resident memory of the engine process over a long run, with
and without the plugin, and the plugin's per-request state at the end.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
the plugin's structures can be inspected after the run. It generates
``--waves`` waves of ``--prompts`` requests; resident memory is read after
each wave. Growth from wave 1 to the last (``--waves`` times the requests)
is reported for both runs; the plugin's per-request state (tallies of
requests that left their row, remembered freed ids, rows) must stay bounded
by the batch, not grow with the requests served.

    .venv/bin/python -m bench.memory [--waves 10] [--prompts 256] [--max-tokens 32]
"""

from __future__ import annotations

import argparse

from bench._common import engine_env, run_child, tiny_model

MIB = 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waves", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from otel_specdec.demo.receiver import OtlpReceiver

    model = tiny_model()
    config = {"model": model, "mode": "memory", "prompts": args.prompts,
              "max_tokens": args.max_tokens, "waves": args.waves}
    with OtlpReceiver() as receiver:
        endpoint = receiver.endpoint("grpc")
        for plugin in (True, False):
            env = engine_env(plugin, endpoint, VLLM_ENABLE_V1_MULTIPROCESSING="0")
            r = run_child(config, env)
            rss = [b / MIB for b in r["rss_bytes"]]
            print(f"plugin={'on ' if plugin else 'off'}: RSS after wave 1 {rss[0]:.1f} MiB, "
                  f"after wave {len(rss)} ({len(rss)}x the requests) {rss[-1]:.1f} MiB, "
                  f"growth {rss[-1] - rss[0]:+.1f} MiB; per wave: "
                  + " ".join(f"{x:.0f}" for x in rss), flush=True)
            if plugin:
                print(f"  plugin state after {len(rss) * r['requests_per_wave']} requests: "
                      f"{r.get('plugin_state')}")


if __name__ == "__main__":
    main()
