"""Which engine processes still owe their final export, told across processes.

An engine process that vLLM's process manager kills (SIGKILL, after its
shutdown timeout) cannot say that its last interval was lost: it is gone
before it could log. The manager's process can, if it knows that the export
had not ended. So each engine process that counts keeps a file while its
final export is owed, named by its pid, in a folder named by the pid of
the process that manages it (its parent), which the manager's process
creates for the speculative engines it starts (``_shutdown_grace``). The
engine removes the file once its final export has ended, delivered or not
(where it was not delivered, the engine itself says so). After vLLM's
shutdown, the manager's process warns once for each engine whose file is
still there, and removes the folder.

Nothing is written where the parent made no folder: an engine in the
front end's own process, or one started by another launcher.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["open_for_engines", "owe", "report_unsettled", "settle"]

_logger = logging.getLogger(__name__)

# How long the manager's process waits for an engine process that vLLM has
# just killed to be reaped before it reads that engine's file.
REAP_WAIT_S = 1.0


def _folder(manager_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"otel-specdec-{os.getuid()}-{manager_pid}"


def open_for_engines() -> None:
    """In the manager's process, before it starts engine processes."""
    _folder(os.getpid()).mkdir(mode=0o700, exist_ok=True)


def _own_file() -> Path:
    return _folder(os.getppid()) / str(os.getpid())


def owe() -> None:
    """In an engine process that starts counting: its final export is owed."""
    try:
        if _folder(os.getppid()).is_dir():
            _own_file().touch()
    except OSError:
        _logger.debug("otel_specdec: could not record the owed export", exc_info=True)


def settle() -> None:
    """In an engine process whose final export has ended."""
    try:
        _own_file().unlink(missing_ok=True)
    except OSError:
        _logger.debug("otel_specdec: could not settle the owed export", exc_info=True)


def report_unsettled(processes: Iterable[Any], timeout_s: float | None) -> None:
    """In the manager's process, after vLLM's shutdown of ``processes``: one
    warning for each that ended still owing its final export.

    A process still running (another thread's shutdown is waiting for it)
    is left to that shutdown: its file stays until it is read there.
    """
    folder = _folder(os.getpid())
    deadline = time.monotonic() + REAP_WAIT_S
    for process in processes:
        pid = getattr(process, "pid", None)
        if pid is None or not (folder / str(pid)).exists():
            continue
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            continue
        try:  # the claim: one warning, whichever thread's shutdown gets here first
            (folder / str(pid)).unlink()
        except FileNotFoundError:
            continue
        _logger.warning(
            "otel_specdec: engine process %s (pid %d) ended before its final metrics export "
            "had finished (vLLM kills an engine process still running %s after SIGTERM): "
            "the speculative-decoding counts of that engine since its last export that "
            "reached the collector were not delivered",
            getattr(process, "name", "?"), pid,
            "vLLM's default 5 s" if timeout_s is None else f"{timeout_s:g} s",
        )
    try:
        folder.rmdir()  # once no engine of this process owes an export
    except OSError:
        pass
