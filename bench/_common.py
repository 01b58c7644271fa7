"""Shared by the end-to-end benchmarks: the tiny model and child engine runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHILD = "bench._engine_child"


def tiny_model() -> str:
    from otel_specdec.demo.tiny_model import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp()) / "target"))


def engine_env(plugin: bool, endpoint: str, **extra: str) -> dict[str, str]:
    """The child's environment: the plugin exporting to ``endpoint``, or no plugin."""
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_METRIC_EXPORT_INTERVAL": "5000",
           "OTEL_METRICS_EXPORTER": "otlp", "VLLM_LOGGING_LEVEL": "WARNING", **extra}
    if not plugin:
        env["VLLM_PLUGINS"] = ""
    else:
        env.pop("VLLM_PLUGINS", None)
    return env


def run_child(config: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", CHILD, json.dumps(config)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine run failed ({proc.returncode}): {proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])
