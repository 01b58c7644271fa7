"""``otel-specdec demo``: the whole path on this machine, nothing configured.

Builds a tiny model locally, runs real vLLM with ngram and draft-model
speculation under the plugin, receives the OTLP export on loopback and
prints what a dashboard would show next to vLLM's own counters. With
``OTEL_EXPORTER_OTLP_ENDPOINT`` set, the metrics go there instead.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from otel_specdec.demo.engine_run import run_in_child
from otel_specdec.demo.receiver import MetricsStore, OtlpReceiver

__all__ = ["main"]

_K = 3


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _with_progress(label: str, func: Any, *args: Any) -> Any:
    """Run ``func`` while printing elapsed seconds, so a slow start is visible."""
    done = threading.Event()
    start = time.monotonic()

    def ticker() -> None:
        while not done.wait(5.0):
            _say(f"  ... {label}: {time.monotonic() - start:.0f} s")

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    try:
        return func(*args)
    finally:
        done.set()
        _say(f"  {label}: done in {time.monotonic() - start:.1f} s")


def _run_engine(config: dict[str, Any], env: dict[str, str], log_path: Path) -> dict[str, Any]:
    with open(log_path, "w") as log:
        try:
            return run_in_child(config, env, stderr=log)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; engine log: {log_path}") from None


def _received(store: MetricsStore) -> dict[str, Any]:
    return {
        **store.spec_decode_totals(),
        "empty_proposals": store.counter_total("vllm.spec_decode.empty_proposals"),
        "requests": store.histogram_total("vllm.spec_decode.request.acceptance_rate"),
    }


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.3f}" if den else "n/a"


def _rows(counts: dict[str, Any]) -> list[tuple[str, str]]:
    drafts, drafted, accepted = counts["drafts"], counts["draft_tokens"], counts["accepted_tokens"]
    rows = [
        ("drafts", str(drafts)),
        ("drafted tokens", str(drafted)),
        ("accepted tokens", str(accepted)),
        ("acceptance rate", _ratio(accepted, drafted)),
        ("mean acceptance length", f"{1 + accepted / drafts:.3f}" if drafts else "n/a"),
    ]
    for position, value in enumerate(counts["accepted_per_pos"]):
        rows.append((f"acceptance at position {position}", _ratio(value, drafts)))
    return rows


def _print_table(title: str, plugin: dict[str, Any] | None, vllm: dict[str, Any]) -> None:
    vllm_rows = _rows(vllm)
    plugin_rows = _rows(plugin) if plugin else [(name, "(sent)") for name, _ in vllm_rows]
    print(f"\n{title}")
    print(f"  {'':<28}{'received over OTLP':>20}{'vLLM get_metrics()':>20}")
    for (name, ours), (_, theirs) in zip(plugin_rows, vllm_rows, strict=True):
        print(f"  {name:<28}{ours:>20}{theirs:>20}")
    if plugin:
        requests = plugin["requests"]
        mean = _ratio(requests.sum, requests.count)
        print(f"  {'empty proposals':<28}{plugin['empty_proposals']:>20}{'-':>20}")
        print(f"  {'requests (mean rate)':<28}{f'{requests.count} ({mean})':>20}{'-':>20}")
        same = all(plugin[key] == vllm[key] for key in
                   ("drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos"))
        print("  plugin totals equal vLLM's own counters: " + ("yes" if same else "NO"))


def main(workdir: str | None = None) -> int:
    from otel_specdec.demo.tiny_model import build_tiny_model

    base = Path(workdir or tempfile.mkdtemp(prefix="otel-specdec-demo-"))
    _say(f"otel-specdec demo (working directory {base})")
    _say("Building a tiny Llama model and tokenizer locally (no hub needed)")
    target = _with_progress("target model", build_tiny_model, base / "target", 0)
    draft = _with_progress("draft model", build_tiny_model, base / "draft", 1)

    runs = [
        ("ngram prompt lookup, k=3",
         {"method": "ngram", "num_speculative_tokens": _K, "prompt_lookup_max": 3,
          "prompt_lookup_min": 1}),
        ("draft model (other weights), k=3",
         {"method": "draft_model", "model": str(draft), "num_speculative_tokens": _K}),
    ]
    external = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    for index, (title, spec) in enumerate(runs):
        config = {"model": str(target), "speculative_config": spec}
        log_path = base / f"vllm-{index}.log"
        _say(f"Running vLLM: {title} (engine log: {log_path})")
        if external:
            result = _with_progress("vLLM run", _run_engine, config, dict(os.environ), log_path)
            _print_table(f"{title}: metrics sent to {external}", None, result["vllm"])
            continue
        with OtlpReceiver() as receiver:
            env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint("grpc"),
                       OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
            result = _with_progress("vLLM run", _run_engine, config, env, log_path)
            _print_table(title, _received(receiver.store), result["vllm"])
    return 0
