"""The patches that let a speculative engine export its last interval.

(Listed with every other patch in ``otel_specdec._patches``.)

Target: ``vllm.v1.engine.core.EngineCore.shutdown``, in the engine-core
process (``DPEngineCoreProc`` calls it through ``super``).

Why: the host tears the executor down first (a worker slow to exit takes
up to vLLM's worker grace plus 4 s before it is killed), then the
scheduler, whose ``shutdown`` exports; after SIGTERM the front end's
grace (below) runs all that time.

How: before the host's, the scheduler's shutdown export
(``_patch._stop_accounting``, handed to ``install``), so a slow worker
exit cannot cut it off. ``Scheduler.shutdown`` then finds nothing left
to do; it stays the export for a scheduler shut down without its engine
core.

Removable when vLLM gives plugins a shutdown hook in the engine core.

Target: ``vllm.v1.engine.utils.CoreEngineProcManager`` (``__init__`` and
``shutdown``, and the ``weakref.finalize`` that ``__init__`` registers),
in the front-end process (the API server, or the process
that created ``LLM``), which starts and stops the engine-core processes.

Why: the engine core exports its last interval from
``Scheduler.shutdown``, which runs when the process leaves its busy loop
after SIGTERM. vLLM's API server stops its engines with
``shutdown(timeout=shutdown_timeout)``, 0 by default, and the process
manager then sends SIGKILL right after SIGTERM: the engine never reaches
its shutdown path and the counts since the last periodic export are lost.
``LLM`` gets vLLM's 5 s grace, shorter than the OTLP export timeout.

How: for a manager whose engine speculates, ``shutdown`` waits up to
``timeout + shutdown budget + teardown margin`` before it SIGKILLs (the
budget, ``OTEL_SPECDEC_SHUTDOWN_TIMEOUT``, bounds the plugin's whole
shutdown, spans included, and has a ceiling).
After vLLM's shutdown (both paths), an engine that still owed its final
export when it ended (killed) gets one warning here, in the process that
killed it (``_export_ledger``): the engine itself cannot log it.
The wait ends as soon as the engine exits; vLLM's own draining rule
(``shutdown_timeout``) is unchanged, because the engine decides by itself
whether to abort or drain. Nothing changes for non-speculative engines.
A script that ends with its ``LLM`` still referenced stops the engine
from the manager's finalizer at interpreter exit, which calls vLLM's
module-level ``shutdown`` with its 5 s default and runs before the
client's own cleanup (it is newer): after the host's ``__init__``, that
finalizer is replaced by one with the same extended timeout.

Removable when vLLM gives engine processes a grace period to run their
shutdown path after SIGTERM.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from wrapt import wrap_function_wrapper

from otel_specdec import _export_ledger, _settings, _vllm_compat

__all__ = ["install", "uninstall"]

_logger = logging.getLogger(__name__)

_GRACE_ATTR = "_otel_specdec_grace_s"
# The rest of the engine's teardown (executor, workers, distributed state).
_TEARDOWN_MARGIN_S = 5.0
# vLLM's own grace when no timeout is given.
_VLLM_DEFAULT_GRACE_S = 5.0

_patched: type | None = None
_engine_core_patched: type | None = None
# Exports what a scheduler's engine counted (_patch._stop_accounting).
_stop_scheduler: Callable[[Any], None] | None = None


def _init_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    grace = None
    try:
        vllm_config = _vllm_compat.process_manager_vllm_config(wrapped, args, kwargs)
        if _vllm_compat.speculates(vllm_config):
            grace = _settings.shutdown_budget_s(report=False) + _TEARDOWN_MARGIN_S
    except Exception:
        _logger.debug("otel_specdec: could not read the engine's config", exc_info=True)
    # Set before the host's __init__, whose failure path calls shutdown.
    try:
        instance.__dict__[_GRACE_ATTR] = grace
        if grace is not None:
            _export_ledger.open_for_engines()
    except Exception:
        _logger.debug("otel_specdec: shutdown grace not prepared", exc_info=True)
    result = wrapped(*args, **kwargs)
    if grace is not None:
        try:
            _extend_finalizer(instance, grace)
        except Exception:
            _logger.debug("otel_specdec: shutdown grace not applied at exit", exc_info=True)
    return result


def _with_grace(timeout: Any, grace: float) -> float:
    """vLLM's timeout (None: its default) plus the grace, never under the default."""
    base = _VLLM_DEFAULT_GRACE_S if timeout is None else float(timeout)
    return max(_VLLM_DEFAULT_GRACE_S, base + grace)


def _extend_finalizer(instance: Any, grace: float) -> None:
    """Re-register the manager's finalizer with the extended timeout."""
    finalizer = _vllm_compat.process_manager_finalizer(instance)
    if finalizer is None or not _vllm_compat.takes_timeout(finalizer.peek()[1]):
        return
    detached = finalizer.detach()
    if detached is None:
        return
    obj, func, args, kwargs = detached
    kwargs = {**kwargs, "timeout": _with_grace(kwargs.get("timeout"), grace)}
    instance.__dict__[_vllm_compat.PROCESS_MANAGER_FINALIZER_ATTR] = weakref.finalize(
        obj, _stop_and_report, func, *args, **kwargs)


def _stop_and_report(stop: Callable[..., Any], processes: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's ``shutdown(procs, timeout)``, then the engines that still owed an export."""
    try:
        return stop(processes, *args, **kwargs)
    finally:
        _report(processes, kwargs.get("timeout"))


def _report(processes: Any, timeout: Any) -> None:
    try:
        _export_ledger.report_unsettled(list(processes or ()), timeout)
    except Exception:
        _logger.debug("otel_specdec: unsettled exports not reported", exc_info=True)


def _extended_timeout(instance: Any, args: Any, kwargs: Any) -> float | None:
    """The timeout to pass instead of the host's, or None to leave it."""
    grace = instance.__dict__.get(_GRACE_ATTR)
    if grace is None or len(args) + len(kwargs) > 1 or (kwargs and "timeout" not in kwargs):
        return None
    return _with_grace(args[0] if args else kwargs.get("timeout"), grace)


def _shutdown_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    try:
        extended = _extended_timeout(instance, args, kwargs)
    except Exception:
        _logger.debug("otel_specdec: shutdown grace not applied", exc_info=True)
        extended = None
    if extended is None:
        return wrapped(*args, **kwargs)
    try:
        return wrapped(timeout=extended)
    finally:
        _report(_vllm_compat.process_manager_processes(instance), extended)


def _engine_shutdown_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    try:
        scheduler = getattr(instance, "scheduler", None)
        if scheduler is not None and _stop_scheduler is not None:
            _stop_scheduler(scheduler)
    except Exception:
        _logger.warning("otel_specdec: flush at shutdown failed", exc_info=True)
    return wrapped(*args, **kwargs)


def install(stop_scheduler: Callable[[Any], None]) -> None:
    """Patch the process manager and the engine core once; each silently
    skipped where it differs."""
    global _patched, _engine_core_patched, _stop_scheduler
    _stop_scheduler = stop_scheduler
    if _engine_core_patched is None:
        engine_core = _vllm_compat.engine_core_class()
        if engine_core is not None:
            wrap_function_wrapper(engine_core, "shutdown", _engine_shutdown_wrapper)
            _engine_core_patched = engine_core
    if _patched is not None:
        return
    cls = _vllm_compat.process_manager_class()
    if cls is None:
        _logger.debug("otel_specdec: %s not found; no shutdown grace",
                      _vllm_compat.PROCESS_MANAGER_CLASS)
        return
    wrap_function_wrapper(cls, "__init__", _init_wrapper)
    wrap_function_wrapper(cls, "shutdown", _shutdown_wrapper)
    _patched = cls


def uninstall() -> None:
    global _patched, _engine_core_patched
    from opentelemetry.instrumentation.utils import unwrap

    for cls, methods in ((_patched, ("__init__", "shutdown")),
                         (_engine_core_patched, ("shutdown",))):
        if cls is not None:
            for method in methods:
                unwrap(cls, method)
    _patched = _engine_core_patched = None
