"""Run a blocking OpenTelemetry SDK call under a hard time bound.

The SDK bounds most of its waits by the timeouts it is given, but not all:
a reader's thread blocked in a socket read that only the exporter's own
timeout ends, a span processor's join, retries that sleep past the deadline
in older exporters. What the plugin waits for inside a stopping engine
must end within a bound that no setting or collector can stretch, so such
a call runs on a daemon thread and the caller waits for it at most that
long. A call still running then is abandoned: its thread ends with the
process, and nothing the engine does waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Deadline", "call_within"]

_logger = logging.getLogger(__name__)


class Deadline:
    """A point in time, ``budget_s`` from now."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self._at = time.monotonic() + budget_s

    def remaining_s(self) -> float:
        return max(0.0, self._at - time.monotonic())


def call_within(func: Callable[[], object], timeout_s: float, what: str) -> bool:
    """Run ``func``, waiting at most ``timeout_s``; True if it finished.

    An exception from ``func`` is logged (it finished, badly) and never
    raised to the caller.
    """
    done = threading.Event()

    def run() -> None:
        try:
            func()
        except Exception:
            _logger.warning("otel_specdec: %s failed", what, exc_info=True)
        finally:
            done.set()

    if timeout_s <= 0:
        return False
    try:
        threading.Thread(target=run, name=f"otel-specdec-{what}", daemon=True).start()
    except RuntimeError:  # no new threads at interpreter shutdown: run it here
        run()
    return done.wait(timeout_s)
