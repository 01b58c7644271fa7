"""The patch that lets an idle engine core notice a SIGTERM another thread took.

(Listed with every other patch in ``otel_specdec._patches``.)

Target: ``vllm.v1.engine.core.EngineCoreProc.run_busy_loop`` and
``DPEngineCoreProc.run_busy_loop`` (which overrides it), in the engine-core
process.

Why: the front end stops an engine core with SIGTERM. vLLM's handler asks
the busy loop to stop and wakes it; the loop then leaves, and the engine's
shutdown path runs the plugin's final export. CPython runs a Python signal
handler only in the main thread, and only once that thread runs again. The
kernel may hand a process-wide signal to any thread that does not block it,
and a signal that reaches the main thread just before it blocks in a lock
(after its last check for signals) does not interrupt the wait either. In
both cases the main thread, idle in ``input_queue.get()``, sleeps on: the
handler never runs, the engine never reaches its shutdown path, and the
front end SIGKILLs it when its grace is over. The final export is never
attempted, and an offline job loses every count since its last export
(issue 30: 2 of about 120 own-process engine stops here; the killed
engine's stacks show the main thread in ``input_queue.get()`` and vLLM's
signal-callback thread never triggered).

How: while the busy loop runs, ``signal.set_wakeup_fd`` (which CPython
writes to from whichever thread takes a signal) feeds a daemon thread; on
SIGTERM or SIGINT it puts vLLM's own no-op wake-up request on the engine's
input queue. The main thread wakes, runs the pending handler, and stops as
vLLM intends. A wake-up too many (the main thread took the signal itself)
costs nothing. Nothing is installed outside the main thread, where another
wakeup fd is set (it is left as it is), or where vLLM has no input queue or
request to wake it with.

Removable when vLLM wakes its busy loop from a signal taken by any thread.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from typing import Any

from wrapt import wrap_function_wrapper

from otel_specdec import _vllm_compat

__all__ = ["install", "uninstall"]

_logger = logging.getLogger(__name__)

_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
_patched: list[type] = []
_fork_hook_registered = False
# The write end this process set as the wakeup fd, while a busy loop runs.
_wakeup_fd: int | None = None


class _Waker:
    """Reads the signal wakeup fd; wakes the engine's busy loop on a stop signal."""

    def __init__(self, engine_queue: Any, request: tuple[Any, Any]) -> None:
        self._queue = engine_queue
        self._request = request
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)

    def start(self) -> bool:
        """Set the wakeup fd and start reading it; False (nothing changed) where
        another wakeup fd was set."""
        global _wakeup_fd
        previous = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            self._close()
            _logger.debug("otel_specdec: a signal wakeup fd is set already; left as it is")
            return False
        _wakeup_fd = self._write_fd
        threading.Thread(target=self._read, name="otel-specdec-signal-wake",
                         daemon=True).start()
        return True

    def _read(self) -> None:
        try:
            while data := os.read(self._read_fd, 64):
                if _STOP_SIGNALS.intersection(data):
                    self._queue.put_nowait(self._request)
        except (OSError, queue.Full):
            _logger.debug("otel_specdec: signal wake-up reader stopped", exc_info=True)
        finally:
            os.close(self._read_fd)

    def stop(self) -> None:
        """Unset the wakeup fd (in the main thread); the reader ends at EOF."""
        global _wakeup_fd
        current = signal.set_wakeup_fd(-1)
        if current != self._write_fd:  # someone else's since: theirs stays
            signal.set_wakeup_fd(current)
        _wakeup_fd = None
        os.close(self._write_fd)

    def _close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)


def _start_waker(engine: Any) -> _Waker | None:
    if threading.current_thread() is not threading.main_thread():
        return None  # set_wakeup_fd is the main thread's (a Ray actor's loop is not)
    request = _vllm_compat.engine_wakeup_request()
    engine_queue = getattr(engine, "input_queue", None)
    if request is None or engine_queue is None:
        return None
    waker = _Waker(engine_queue, request)
    return waker if waker.start() else None


def _busy_loop_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    try:
        waker = _start_waker(instance)
    except Exception:
        _logger.debug("otel_specdec: signal wake-up not set", exc_info=True)
        waker = None
    try:
        return wrapped(*args, **kwargs)
    finally:
        if waker is not None:
            try:
                waker.stop()
            except Exception:
                _logger.debug("otel_specdec: signal wake-up not unset", exc_info=True)


def _forget_in_child() -> None:
    """A forked child (a worker, started by fork) gets no busy loop of its
    own: the parent's wakeup fd must not stay set there."""
    global _wakeup_fd
    if _wakeup_fd is None:
        return
    _wakeup_fd = None
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass


def install() -> None:
    """Wrap each busy loop vLLM defines; silently none where it has none."""
    global _fork_hook_registered
    if _patched:
        return
    for cls in _vllm_compat.engine_busy_loop_classes():
        wrap_function_wrapper(cls, "run_busy_loop", _busy_loop_wrapper)
        _patched.append(cls)
    if _patched and not _fork_hook_registered:
        os.register_at_fork(after_in_child=_forget_in_child)
        _fork_hook_registered = True


def uninstall() -> None:
    from opentelemetry.instrumentation.utils import unwrap

    for cls in _patched:
        unwrap(cls, "run_busy_loop")
    _patched.clear()
