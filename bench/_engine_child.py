"""One real vLLM engine run for the end-to-end benchmarks (run in a child process).

    python -m bench._engine_child '<json config>'

Builds ``LLM`` (CPU build, the tiny model, ngram speculation), warms it up,
then either times generation (``"mode": "throughput"``: output tokens per
second) or generates in waves and reports the engine process's resident
memory after each (``"mode": "memory"``). Prints one JSON line prefixed with
``RESULT``. Whether the plugin loads is decided by the parent through
``VLLM_PLUGINS``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

PREFIX = "RESULT "


def _prompts(n: int) -> list[str]:
    from otel_specdec.demo.engine_run import DEFAULT_PROMPTS

    return [f"{DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]} {i}" for i in range(n)]


def _engine_rss_bytes() -> int:
    """Resident memory of the engine: this process, or its engine-core child."""
    import psutil

    me = psutil.Process()
    children = me.children(recursive=True)
    procs = children if children else [me]
    return sum(p.memory_info().rss for p in procs)


def _plugin_state(llm: Any) -> dict[str, int]:
    """Sizes of the plugin's per-request structures (in-process engine only)."""
    from otel_specdec import _patch

    # LLM -> LLMEngine -> in-process client -> EngineCore -> Scheduler
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    accountant = _patch._attached(scheduler)
    if accountant is None:
        return {"accountant": 0}
    return {"accountant": 1, "live_requests": len(scheduler.requests),
            **accountant.held_state()}


def _timed_generate(llm: Any, prompts: list[str], params: Any) -> dict[str, float]:
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def _toggle_rounds(llm: Any, prompts: list[str], params: Any, rounds: int) -> list[dict]:
    """Same engine, the plugin's patches on and off in turn (ABBA order)."""
    from otel_specdec import SpecDecodeInstrumentor

    instrumentor = SpecDecodeInstrumentor()
    out = []
    for i in range(rounds):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            if on and not instrumentor.is_instrumented_by_opentelemetry:
                instrumentor.instrument(skip_dep_check=True)
            elif not on and instrumentor.is_instrumented_by_opentelemetry:
                instrumentor.uninstrument()
            # Untimed: the plugin builds its exporter on the first step after
            # instrument(), which an engine does once, at start-up.
            llm.generate(prompts[:4], params, use_tqdm=False)
            out.append({"plugin": on, **_timed_generate(llm, prompts, params)})
    return out


def _choose_accounting(accounting: str) -> None:
    """"exact": the exact path only, as where the C pass was not built
    (in-process engine only: the choice is made in this process)."""
    if accounting == "native":
        return
    from otel_specdec import _accounting

    _accounting.NATIVE_SCANNER = None


def main() -> None:
    config: dict[str, Any] = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    _choose_accounting(config.get("accounting", "native"))

    llm = LLM(
        model=config["model"],
        speculative_config={"method": "ngram", "num_speculative_tokens": config.get("k", 4),
                            "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        max_model_len=512, dtype="float32", enforce_eager=True,
        gpu_memory_utilization=0.15, disable_log_stats=False, seed=0,
        max_num_seqs=config.get("max_num_seqs", 256),
    )
    params = SamplingParams(temperature=0.0, max_tokens=config["max_tokens"], ignore_eos=True)
    prompts = _prompts(config["prompts"])
    llm.generate(prompts[:16], params, use_tqdm=False)  # warm-up
    result: dict[str, Any] = {"plugin_loaded": os.environ.get("VLLM_PLUGINS") != ""}
    if config["mode"] == "throughput":
        result.update(_timed_generate(llm, prompts, params))
    elif config["mode"] == "toggle":
        result["rounds"] = _toggle_rounds(llm, prompts, params, config["rounds"])
    else:
        rss, states = [], []
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        for _ in range(config["waves"]):
            llm.generate(prompts, params, use_tqdm=False)
            gc.collect()
            rss.append(_engine_rss_bytes())
            if in_process:
                states.append(_plugin_state(llm))
        result.update(rss_bytes=rss, requests_per_wave=len(prompts), plugin_states=states)
    print(PREFIX + json.dumps(result), flush=True)
    del llm


if __name__ == "__main__":
    main()
