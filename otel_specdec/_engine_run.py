"""Run real vLLM with speculative decoding once and report what it counted.

``python -m otel_specdec._engine_run '<json>'`` builds an ``LLM`` with the
given speculative config, generates greedily, and prints one JSON line with
the generated token ids and vLLM's own ``spec_decode`` counters from
``LLM.get_metrics()``. The demo and the tests run it in a child process, so
that the engine starts the way it does in production (engine core in its
own process) and the plugin loads through vLLM's entry point.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from typing import Any

from otel_specdec._receiver import add_elementwise

__all__ = ["run", "run_in_child", "DEFAULT_PROMPTS", "PHASE_PREFIX", "RESULT_PREFIX"]

RESULT_PREFIX = "OTEL_SPECDEC_RESULT "
PHASE_PREFIX = "OTEL_SPECDEC_PHASE "

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


def _build_llm(config: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=config["model"],
        speculative_config=config.get("speculative_config"),
        max_model_len=512,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.15,
        disable_log_stats=config.get("disable_log_stats", False),
        seed=0,
    )


def _generate(llm: Any, config: dict[str, Any], result: dict[str, Any]) -> None:
    """``config["phases"]`` rounds of generation (default 1).

    Between rounds the child prints ``PHASE_PREFIX <n> <vLLM's counters as
    JSON>`` and waits for a line on stdin, so a test can change the world (start or stop a
    collector) while the engine is up. ``config["hold"]`` pauses also before
    the first round and after the last (the engine idle, still serving).
    """
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=config.get("max_tokens", 48),
                            ignore_eos=True)
    prompts = config.get("prompts") or DEFAULT_PROMPTS
    result_has_counters = not config.get("disable_log_stats", False)
    result["gen_seconds"], result["output_tokens"] = [], []
    hold = config.get("hold", False)

    def pause(phase: int) -> None:
        counters = json.dumps(vllm_counters(llm)) if result_has_counters else "{}"
        print(f"{PHASE_PREFIX}{phase} {counters}", flush=True)
        sys.stdin.readline()

    for phase in range(config.get("phases", 1)):
        if phase or hold:
            pause(phase)
        start = time.perf_counter()
        if config.get("trace_headers"):
            outputs = _generate_with_headers(llm, prompts, params, config["trace_headers"])
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        result["gen_seconds"].append(time.perf_counter() - start)
        result["output_tokens"].append(sum(len(o.outputs[0].token_ids) for o in outputs))
        result["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
    if hold:
        pause(config.get("phases", 1))
    if result_has_counters:
        result["vllm"] = vllm_counters(llm)


def _generate_with_headers(llm: Any, prompts: list[str], params: Any,
                           headers: list[dict[str, str] | None]) -> list[Any]:
    """``LLM.generate`` takes no trace headers; vLLM's engine API does."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"traced-{i}", prompt, params, trace_headers=headers[i])
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[f"traced-{i}"] for i in range(len(prompts))]


def _run_in_scope(config: dict[str, Any], result: dict[str, Any]) -> None:
    # The LLM is only referenced here: it goes when this function returns.
    _generate(_build_llm(config), config, result)


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Build, generate, shut down; ``shutdown_seconds`` is the time to drop the LLM."""
    result: dict[str, Any] = {}
    if config.get("drop") == "scope":
        _run_in_scope(config, result)  # the LLM is gone when this returns
        start = time.perf_counter()
        gc.collect()
    else:
        llm = _build_llm(config)
        _generate(llm, config, result)
        start = time.perf_counter()
        del llm
    result["shutdown_seconds"] = time.perf_counter() - start
    return result


def run_in_child(config: dict[str, Any], env: dict[str, str], *,
                 launcher: tuple[str, ...] = (), stderr: Any = subprocess.PIPE,
                 timeout: float | None = None) -> dict[str, Any]:
    """``run(config)`` in a fresh Python process with ``env``; its result.

    ``launcher`` prefixes the command (e.g. ``opentelemetry-instrument``).
    With the default ``stderr``, the child's log is returned as ``"stderr"``.
    """
    proc = subprocess.run(
        [*launcher, sys.executable, "-m", "otel_specdec._engine_run", json.dumps(config)],
        env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        log = proc.stderr[-6000:] if proc.stderr else "(see the engine log)"
        raise RuntimeError(f"vLLM run failed (exit {proc.returncode}): {log}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    if proc.stderr is not None:
        result["stderr"] = proc.stderr
    return result


def main() -> None:
    config = json.loads(sys.argv[1])
    result = run(config)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
