"""The tests' engine run: ``otel_specdec.demo.engine_run`` plus test knobs.

``python tests/engine_child.py '<json>'`` (through ``run_in_child``) builds
an ``LLM`` as the demo does and adds what only tests need:

* ``phases``: rounds of generation. Between rounds the child prints
  ``PHASE_PREFIX <n> <vLLM's counters as JSON>`` and waits for a line on
  stdin, so a test can change the world (start or stop a collector) while
  the engine is up. ``hold`` pauses also before the first round and after
  the last (the engine idle, still serving).
* ``trace_headers``: one dict (or None) per prompt, handed to vLLM's engine
  API (``LLM.generate`` takes none).
* ``drop``: ``"scope"`` lets the ``LLM`` go out of scope (garbage collected)
  instead of ``del``; ``"exit"`` keeps it referenced until the interpreter
  exits, as a script that never deletes it does.
* ``probe_executor_shutdown`` (engine core in this process only): the
  result's ``executor_shutdown_at`` is when (``time.time()``) the engine
  began tearing its executor down.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from otel_specdec.demo import engine_run
from otel_specdec.demo.engine_run import DEFAULT_PROMPTS, RESULT_PREFIX, vllm_counters

__all__ = ["PHASE_PREFIX", "RESULT_PREFIX", "ENTRY", "assert_delivered", "run",
           "run_in_child", "shutdown_evidence", "with_child_site"]

PHASE_PREFIX = "OTEL_SPECDEC_PHASE "
# What child_site's own log lines start with (never "otel_specdec": a run
# without the plugin must not show the plugin's name).
TEST_SITE_MARK = "specdec-test:"
# What a child process runs: this file.
ENTRY = (str(Path(__file__).resolve()),)
# Start-up code for every process of a child (child_site/sitecustomize.py).
CHILD_SITE = Path(__file__).with_name("child_site")


def _generate(llm: Any, config: dict[str, Any], result: dict[str, Any]) -> None:
    result_has_counters = not config.get("disable_log_stats", False)
    hold = config.get("hold", False)

    def pause(phase: int) -> None:
        counters = json.dumps(vllm_counters(llm)) if result_has_counters else "{}"
        print(f"{PHASE_PREFIX}{phase} {counters}", flush=True)
        sys.stdin.readline()

    for phase in range(config.get("phases", 1)):
        if phase or hold:
            pause(phase)
        if config.get("trace_headers"):
            _generate_with_headers(llm, config, result)
        else:
            engine_run.generate(llm, config, result)
    if hold:
        pause(config.get("phases", 1))
    if result_has_counters:
        result["vllm"] = vllm_counters(llm)


def _generate_with_headers(llm: Any, config: dict[str, Any], result: dict[str, Any]) -> None:
    """``LLM.generate`` takes no trace headers; vLLM's engine API does."""
    prompts = config.get("prompts") or DEFAULT_PROMPTS
    params = engine_run.sampling_params(config)
    engine = llm.llm_engine
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"traced-{i}", prompt, params,
                           trace_headers=config["trace_headers"][i])
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    outputs = [finished[f"traced-{i}"] for i in range(len(prompts))]
    engine_run.record_round(result, outputs, time.perf_counter() - start)


# An LLM left for the interpreter's exit to stop (``drop="exit"``).
_kept_until_exit: list[Any] = []


def _probe_executor_shutdown(llm: Any, result: dict[str, Any]) -> None:
    """Note when the in-process engine core starts its executor's teardown."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    original = executor.shutdown

    def shutdown() -> None:
        result.setdefault("executor_shutdown_at", time.time())
        original()

    executor.shutdown = shutdown


def _run_in_scope(config: dict[str, Any], result: dict[str, Any]) -> None:
    # The LLM is only referenced here: it goes when this function returns.
    _generate(engine_run.build_llm(config), config, result)


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Build, generate, shut down; ``shutdown_seconds`` is the time to drop the LLM."""
    result: dict[str, Any] = {}
    if config.get("drop") == "scope":
        _run_in_scope(config, result)  # the LLM is gone when this returns
        start = time.perf_counter()
        gc.collect()
    else:
        llm = engine_run.build_llm(config)
        if config.get("probe_executor_shutdown"):
            _probe_executor_shutdown(llm, result)
        _generate(llm, config, result)
        if config.get("drop") == "exit":
            _kept_until_exit.append(llm)
            return result
        start = time.perf_counter()
        del llm
    result["shutdown_seconds"] = time.perf_counter() - start
    return result


def run_in_child(config: dict[str, Any], env: dict[str, str], **kwargs: Any) -> dict[str, Any]:
    """``run(config)`` in a fresh Python process (see ``engine_run.run_in_child``)."""
    return engine_run.run_in_child(config, env, entry=ENTRY, **kwargs)


def with_child_site(env: dict[str, str], **settings: str) -> dict[str, str]:
    """``env`` for a child whose every process runs ``child_site`` at start-up,
    with its ``settings`` (``SPECDEC_TEST_*``); the plugin's log is timed."""
    path = os.pathsep.join(filter(None, [str(CHILD_SITE), env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path, "SPECDEC_TEST_TIMED_LOG": "1",
            "SPECDEC_TEST_STACKS_BEFORE_KILL": "1", **settings}


def shutdown_evidence(result: dict[str, Any], store: Any = None) -> str:
    """How a child's engine stopped, for a failure message: the plugin's
    (timed) log lines, vLLM's ``[shutdown]`` lines and when the receiver
    got each export (wall clock)."""
    stderr = result.get("stderr", "")
    plugin = [line for line in stderr.splitlines()
              if "otel_specdec" in line or TEST_SITE_MARK in line]
    arrivals = [time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"
                for t in (store.received_at if store is not None else [])]
    refused = store.refused if store is not None else []
    return "\n".join(["plugin:", *plugin, "vLLM:", result.get("shutdown_log", ""),
                      f"receiver got exports at: {arrivals}", f"receiver refused: {refused}",
                      machine_load(), *stacks_before_kill(stderr)])


def assert_delivered(store: Any, result: dict[str, Any]) -> None:
    """The receiver's totals are vLLM's counters for the child's run; else
    the failure says how its engine stopped (``shutdown_evidence``)."""
    assert store.spec_decode_totals() == result["vllm"], shutdown_evidence(result, store)


def stacks_before_kill(stderr: str) -> list[str]:
    """The threads' stacks that ``child_site`` had each process of a killed
    engine write (``faulthandler``) just before vLLM SIGKILLed it."""
    return [line for line in stderr.splitlines()
            if line.startswith(("Thread 0x", "Current thread 0x", "  File "))]


def machine_load() -> str:
    """The load average and the busiest processes now: a loss seen only in
    full-suite runs may come from CPU taken by something else (issue 30)."""
    try:
        busiest = subprocess.run(
            ["ps", "-eo", "pid,ppid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True,
            text=True, timeout=5).stdout.splitlines()[:8]
    except (OSError, subprocess.SubprocessError) as exc:
        busiest = [f"ps failed: {exc}"]
    return "\n".join([f"load average: {os.getloadavg()}",
                      *(line[:160] for line in busiest)])


def main() -> None:
    result = run(json.loads(sys.argv[1]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
