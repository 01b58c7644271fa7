"""rotel-agent (the Rust OTLP collector on PyPI as ``rotel``) for the tests:
where the binary is, which ROTEL_* variables it accepts, and the agent
started in the foreground from the shipped ``collector-config/rotel.env``."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from fault_helpers import free_port

CONFIG_DIR = Path(__file__).resolve().parent.parent / "collector-config"
ROTEL_ENV = CONFIG_DIR / "rotel.env"

# Sourced by a POSIX shell, as collector-config/README.md tells users; exec
# keeps the process handle on rotel-agent itself (no daemon, no pid file).
_LAUNCH = 'set -a; . "$1"; set +a; exec "$2" start'


def rotel_agent_path() -> Path | None:
    """The binary shipped in the ``rotel`` wheel, else one on PATH."""
    try:
        import rotel
    except ImportError:
        found = shutil.which("rotel-agent")
        return Path(found) if found else None
    path = Path(rotel.__file__).with_name("rotel-agent")
    return path if os.access(path, os.X_OK) else None


def require_rotel_agent() -> Path:
    """The binary; without it the test fails under CI=true, else skips."""
    path = rotel_agent_path()
    if path is None:
        message = "rotel-agent not found: pip install rotel"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@cache
def accepted_variables(agent: Path) -> frozenset[str]:
    """Every ROTEL_* variable that ``rotel-agent start --help`` lists."""
    out = subprocess.run([str(agent), "start", "--help"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    names = frozenset(re.findall(r"\[env: (ROTEL_[A-Z0-9_]+)=", out))
    assert "ROTEL_OTLP_EXPORTER_ENDPOINT" in names, out[:2000]
    return names


def agent_version(agent: Path) -> str:
    return subprocess.run([str(agent), "--version"], capture_output=True, text=True,
                          timeout=30, check=True).stdout.strip()


def source_env_file(env_file: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Source ``env_file`` as the docs say and print the resulting ROTEL_* environment."""
    return subprocess.run(["sh", "-c", 'set -a; . "$1"; set +a; env', "sh", str(env_file)],
                          env=env, capture_output=True, text=True, timeout=30)


def base_env(**overrides: str) -> dict[str, str]:
    """This environment without ROTEL_* settings, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTEL_")}
    env.update(overrides)
    return env


class RotelAgent:
    """rotel-agent started in the foreground from ``env_file`` on free
    loopback ports, forwarding to ``exporter_endpoint``; stopped (SIGTERM,
    which flushes its batches) on exit."""

    def __init__(self, agent: Path, exporter_endpoint: str, *, env_file: Path = ROTEL_ENV,
                 **env: str) -> None:
        self.agent = agent
        self.env_file = env_file
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.env = base_env(
            ROTEL_OTLP_GRPC_ENDPOINT=f"127.0.0.1:{self.grpc_port}",
            ROTEL_OTLP_HTTP_ENDPOINT=f"127.0.0.1:{self.http_port}",
            ROTEL_OTLP_EXPORTER_ENDPOINT=exporter_endpoint,
            **env,
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self._log = tempfile.TemporaryFile()

    def endpoint(self, protocol: str) -> str:
        port = self.grpc_port if protocol == "grpc" else self.http_port
        return f"http://127.0.0.1:{port}"

    def log(self) -> str:
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return re.sub(r"\x1b\[[0-9;]*m", "", text)

    def start(self, timeout: float = 20) -> RotelAgent:
        self.proc = subprocess.Popen(
            ["sh", "-c", _LAUNCH, "rotel", str(self.env_file), str(self.agent)],
            env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        waiting = {self.grpc_port, self.http_port}
        while waiting:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rotel-agent exited ({self.proc.returncode}): {self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rotel-agent not listening after {timeout}s: {self.log()}")
            for port in list(waiting):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    waiting.discard(port)
                except OSError:
                    pass
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 15) -> int | None:
        if self.proc is None or self.returncode is not None:
            return self.returncode
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        return self.returncode

    def __enter__(self) -> RotelAgent:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.stop()
