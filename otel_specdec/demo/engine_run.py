"""Run real vLLM with speculative decoding once and report what it counted.

``python -m otel_specdec.demo.engine_run '<json>'`` builds an ``LLM`` with the
given speculative config, generates greedily, and prints one JSON line with
the generated token ids and vLLM's own ``spec_decode`` counters from
``LLM.get_metrics()``. The demo and the tests run it in a child process, so
that the engine starts the way it does in production (engine core in its
own process) and the plugin loads through vLLM's entry point.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from otel_specdec.demo.receiver import add_elementwise

__all__ = [
    "DEFAULT_PROMPTS", "KV_CACHE_BYTES", "RESULT_PREFIX", "build_llm", "generate",
    "record_round", "run", "run_in_child", "sampling_params", "vllm_counters",
]

RESULT_PREFIX = "OTEL_SPECDEC_RESULT "
# The KV cache, sized explicitly. Left to vLLM's CPU build, it is
# gpu_memory_utilization of the machine's memory (3.5 GiB of 24 GiB here),
# and allocating that took 12-15 s of every engine start; 64 MiB holds
# 65,536 tokens of the tiny model, far more than a run needs.
KV_CACHE_BYTES = 64 * 2**20

DEFAULT_PROMPTS = [
    "the quick brown fox jumps over the lazy dog, the quick brown fox",
    "one two three four five six seven eight nine ten one two three",
    "Speculative decoding drafts several tokens and lets the target model verify them.",
    "The scheduler counts draft tokens, accepted tokens and the acceptance per position.",
    "OpenTelemetry exports counters and histograms to any collector over OTLP.",
    "A draft that agrees with the target is accepted; the first rejection ends the prefix.",
    "one two three one two three one two three",
    "the lazy dog the lazy dog the lazy",
]

_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_counters(llm: Any) -> dict[str, Any]:
    """vLLM's own speculative-decoding counters, summed over engines."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                           "accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in _COUNTERS:
            out[_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == _PER_POS:
            add_elementwise(out["accepted_per_pos"], [int(v) for v in metric.values])
    return out


def build_llm(config: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=config["model"],
        speculative_config=config.get("speculative_config"),
        max_model_len=512,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.15,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        disable_log_stats=config.get("disable_log_stats", False),
        seed=0,
    )


def sampling_params(config: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=config.get("max_tokens", 48),
                          ignore_eos=True)


def record_round(result: dict[str, Any], outputs: list[Any], seconds: float) -> None:
    """One round's time, output tokens and token ids, into ``result``."""
    result.setdefault("gen_seconds", []).append(seconds)
    result.setdefault("output_tokens", []).append(
        sum(len(o.outputs[0].token_ids) for o in outputs))
    result["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]


def generate(llm: Any, config: dict[str, Any], result: dict[str, Any]) -> list[Any]:
    """One round of greedy generation, recorded in ``result``."""
    prompts = config.get("prompts") or DEFAULT_PROMPTS
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling_params(config), use_tqdm=False)
    record_round(result, outputs, time.perf_counter() - start)
    return outputs


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Build, generate, shut down; ``shutdown_seconds`` is the time to drop the LLM."""
    result: dict[str, Any] = {}
    llm = build_llm(config)
    generate(llm, config, result)
    if not config.get("disable_log_stats", False):
        result["vllm"] = vllm_counters(llm)
    start = time.perf_counter()
    del llm
    result["shutdown_seconds"] = time.perf_counter() - start
    return result


def run_in_child(config: dict[str, Any], env: dict[str, str], *,
                 launcher: tuple[str, ...] = (), stderr: Any = subprocess.PIPE,
                 timeout: float | None = None,
                 entry: tuple[str, ...] = ("-m", __name__),
                 python: str = sys.executable) -> dict[str, Any]:
    """``run(config)`` in a fresh Python process with ``env``; its result.

    ``launcher`` prefixes the command (e.g. ``opentelemetry-instrument``).
    With the default ``stderr``, the child's log is returned as ``"stderr"``;
    vLLM's ``[shutdown]`` log lines (on stdout) as ``"shutdown_log"``.
    ``entry``: what the child runs (a module or script whose ``main`` prints
    one ``RESULT_PREFIX`` line); ``python``: the interpreter (another venv's).
    """
    proc = subprocess.run(
        [*launcher, python, *entry, json.dumps(config)],
        env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        log = proc.stderr[-6000:] if proc.stderr else "(see the engine log)"
        raise RuntimeError(f"vLLM run failed (exit {proc.returncode}): {log}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    if proc.stderr is not None:
        result["stderr"] = proc.stderr
    # vLLM logs to stdout: its shutdown steps tell how the engine ended.
    result["shutdown_log"] = "\n".join(
        line for line in proc.stdout.splitlines() if "[shutdown]" in line)
    return result


def main() -> None:
    config = json.loads(sys.argv[1])
    result = run(config)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
