"""The ``otel-specdec`` console command."""

from __future__ import annotations

import argparse

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="otel-specdec",
        description="OpenTelemetry metrics for vLLM speculative decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run real vLLM with speculative decoding on a tiny local model and show "
        "the exported metrics next to vLLM's own counters",
    )
    demo.add_argument("--workdir", help="where to build the model (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from otel_specdec.demo.run import main as demo_main

        return demo_main(args.workdir)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
