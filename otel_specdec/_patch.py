"""The patches on vLLM's scheduler.

(Listed with every other patch in ``otel_specdec._patches``.)

Target: ``vllm.v1.core.sched.scheduler.Scheduler`` (subclasses such as
``AsyncScheduler`` inherit the wrapped methods).

* ``__init__``: after the host's, attach a ``StepAccountant`` to a scheduler
  whose engine speculates (and build the process's meter provider then).
* ``update_from_output``: before the host's, account the step from the
  call's own arguments. Before, because the host mutates request state and
  output lists as it goes; the accounting reads exactly what the host's own
  statistics code reads at the top of its loop. The host's result is
  returned untouched. After the host's update, the requests it finished
  are read in bulk from vLLM's own set of requests freed since the last
  schedule (``Scheduler.finished_req_ids``); each tally becomes one
  per-request acceptance-rate value. No hook runs per finished request.
  Before the step, the step's own set (``SchedulerOutput.finished_req_ids``)
  is a safety net for requests freed where no hook saw them. This method is
  replaced by a plain function rather than a wrapt wrapper: it runs every
  step, where wrapt's dispatch alone measured more than the 2% budget.
* ``finish_requests``: after the host's (aborts, between steps), the
  requests it freed are released the same way, so an engine that goes idle
  after an abort still exports their rates.
* ``shutdown``: after the host's, export what the engine counted: the last
  engine of the plugin's own provider shuts it down (one final export,
  then spans, all within the shutdown budget, which the front end adds to
  vLLM's grace period before it kills an engine process); otherwise the
  provider is flushed. Engine-core
  processes started by fork end without running exit hooks, so this is
  where the last interval's counts leave the process. The front end's
  process manager gives it the time to (``_shutdown_grace``).
  An engine core exports earlier, before its executor's teardown
  (``_shutdown_grace``); this one then finds nothing left to do.

Why patch: vLLM exposes these numbers only to its Prometheus and logging
stat loggers, and only when stats logging is on. Removable when vLLM offers
a stat-logger or scheduler hook that carries per-step speculative data to
plugins regardless of ``disable_log_stats``.

No exception from the plugin reaches vLLM: a failure is logged once, and
the scheduler's accountant is dropped, so the plugin stops rather than
logging every step.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from wrapt import wrap_function_wrapper

from otel_specdec import _runtime, _shutdown_grace, _signal_wake, _vllm_compat
from otel_specdec._accounting import NATIVE_SCANNER, StepAccountant

__all__ = ["install", "uninstall", "is_installed"]

_logger = logging.getLogger(__name__)

# The accountant is kept on the scheduler instance itself: one dict lookup
# per step, and it dies with the scheduler.
_ACCOUNTANT_ATTR = "_otel_specdec_accountant"
# The runtime this scheduler's engine was counted in, told when it shuts down
# (kept apart from the accountant, which a failure drops).
_RUNTIME_ATTR = "_otel_specdec_runtime"

_lock = threading.Lock()
_installed_on: type | None = None
_wrapped_methods: list[str] = []


def _attach(scheduler: Any) -> StepAccountant | None:
    """Give ``scheduler`` an accountant if its engine speculates."""
    accountant = None
    info = _vllm_compat.engine_info(scheduler)
    if info is not None:
        runtime = _runtime.get_or_create(info)
        if runtime is not None:
            accountant = runtime.accountant_for(scheduler, info)
            scheduler.__dict__[_RUNTIME_ATTR] = runtime
            if accountant is not None and _vllm_compat.finished_request_ids(scheduler) is None:
                # The C step tells requests freed mid-step by that set
                # (check_scheduler warned of its absence).
                accountant.step_fast = None
    scheduler.__dict__[_ACCOUNTANT_ATTR] = (_runtime.generation(), accountant)
    return accountant


def _disable(scheduler: Any, where: str) -> None:
    try:
        scheduler.__dict__[_ACCOUNTANT_ATTR] = (_runtime.generation(), None)
    except Exception:  # not a scheduler instance (an unbound call): nothing to mark
        pass
    _logger.exception(
        "otel_specdec: internal error in %s; speculative-decoding metrics are "
        "disabled for this engine, vLLM continues unaffected", where,
    )


def _accountant(scheduler: Any) -> StepAccountant | None:
    entry = scheduler.__dict__.get(_ACCOUNTANT_ATTR)
    if entry is None or entry[0] != _runtime.generation():
        # Instrumented after this scheduler was built, or re-instrumented.
        return _attach(scheduler)
    return entry[1]


def _attached(scheduler: Any) -> StepAccountant | None:
    """The accountant, without attaching one (for the non-step hooks)."""
    entry = scheduler.__dict__.get(_ACCOUNTANT_ATTR)
    return entry[1] if entry is not None and entry[0] == _runtime.generation() else None


def _init_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    wrapped(*args, **kwargs)
    try:
        _attach(instance)
    except Exception:
        _disable(instance, "Scheduler.__init__")


def _split_update_args(args: Any, kwargs: Any) -> tuple[Any, Any]:
    if len(args) >= 2:
        return args[0], args[1]
    if len(args) == 1:
        return args[0], kwargs["model_runner_output"]
    return kwargs["scheduler_output"], kwargs["model_runner_output"]


def _update_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scheduler.update_from_output`` with the step accounted before it.

    A plain function, not a wrapt wrapper: this runs every engine step, just
    after the host's own loop has evicted the plugin's code from the CPU
    caches, and there a wrapt ``FunctionWrapper`` passthrough alone measured
    10-37 µs per step at batch 256 (binding and argument repacking), against
    nothing measurable for a plain function (``bench/step_cost.py``). The
    original is kept in ``__wrapped__`` and restored by ``uninstall``.
    """

    @functools.wraps(original)
    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Every step: few Python calls (each costs about a microsecond here).
        accountant = None
        try:
            entry = self.__dict__.get(_ACCOUNTANT_ATTR)
            if entry is not None and entry[0] == _runtime.generation_now:
                accountant = entry[1]
            else:
                accountant = _accountant(self)
            if accountant is not None:
                if len(args) == 2:
                    scheduler_output, model_runner_output = args
                else:
                    scheduler_output, model_runner_output = _split_update_args(args, kwargs)
                # Requests freed since the schedule (an abort while this step
                # ran): released first, and skipped as vLLM skips them.
                accountant.account_step(scheduler_output, model_runner_output,
                                        getattr(self, _vllm_compat.FINISHED_IDS_ATTR, None))
        except Exception:
            accountant = None
            _disable(self, "Scheduler.update_from_output")
        result = original(self, *args, **kwargs)
        if accountant is not None:
            try:
                # Requests this update finished: their rates are exported
                # now, even if the engine then goes idle.
                accountant.end_step(getattr(self, _vllm_compat.FINISHED_IDS_ATTR, None))
            except Exception:
                _disable(self, "Scheduler.update_from_output")
        return result

    update_from_output._otel_specdec_hook = True  # type: ignore[attr-defined]
    return update_from_output


def _finish_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        accountant = _attached(instance)
        if accountant is not None:
            accountant.release(_vllm_compat.finished_request_ids(instance))
    except Exception:
        _disable(instance, "Scheduler.finish_requests")
    return result


def _stop_accounting(scheduler: Any) -> None:
    """Release what is left and export what the engine counted (once)."""
    if _RUNTIME_ATTR not in getattr(scheduler, "__dict__", {}):
        return  # stopped already, or never counted
    try:
        accountant = _attached(scheduler)
        if accountant is not None:
            # Requests finished since the last update (aborted at shutdown).
            accountant.release(_vllm_compat.finished_request_ids(scheduler))
            accountant.forget_requests()
        runtime = scheduler.__dict__.pop(_RUNTIME_ATTR, None)
        if runtime is not None:
            runtime.engine_stopped()
    except Exception:
        _logger.warning("otel_specdec: flush at shutdown failed", exc_info=True)


def _shutdown_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    try:
        return wrapped(*args, **kwargs)
    finally:
        _stop_accounting(instance)


_MISSING_METHOD_EFFECT = {
    "finish_requests": "aborted requests' rates are recorded at the next step",
    "shutdown": "metrics are not flushed at shutdown",
}

# wrapt wrappers for the methods that do not run every step.
_WRAPPERS = {
    "__init__": _init_wrapper,
    "finish_requests": _finish_wrapper,
    "shutdown": _shutdown_wrapper,
}
# The step method, replaced by a plain function (see _update_hook).
_HOT_METHOD = "update_from_output"


def is_installed() -> bool:
    return _installed_on is not None


def install() -> bool:
    """Patch the scheduler once per process. False if vLLM is unsupported."""
    global _installed_on
    with _lock:
        if _installed_on is not None:
            return True
        scheduler_cls, reason = _vllm_compat.check_scheduler()
        if scheduler_cls is None:
            _logger.warning(
                "otel_specdec: not active: %s. vLLM runs normally without "
                "speculative-decoding telemetry.", reason,
            )
            return False
        for method in _vllm_compat.REQUIRED_METHODS + _vllm_compat.OPTIONAL_METHODS:
            if not _vllm_compat.has_method(scheduler_cls, method):
                _logger.warning(
                    "otel_specdec: Scheduler.%s not found; %s", method,
                    _MISSING_METHOD_EFFECT[method],
                )
                continue
            if method == _HOT_METHOD:
                setattr(scheduler_cls, method, _update_hook(getattr(scheduler_cls, method)))
            else:
                wrap_function_wrapper(scheduler_cls, method, _WRAPPERS[method])
            _wrapped_methods.append(method)
        if "shutdown" in _wrapped_methods:
            _shutdown_grace.install(_stop_accounting)
            _signal_wake.install()
        if NATIVE_SCANNER is None:
            _logger.info("otel_specdec: the C accelerator (otel_specdec._rowscan) is not "
                         "built; the pure-Python accounting serves (a higher cost per step)")
        _installed_on = scheduler_cls
        return True


def uninstall() -> None:
    global _installed_on
    from opentelemetry.instrumentation.utils import unwrap

    with _lock:
        if _installed_on is None:
            return
        for method in _wrapped_methods:
            if method == _HOT_METHOD:
                hook = _installed_on.__dict__.get(method)
                if getattr(hook, "_otel_specdec_hook", False):
                    setattr(_installed_on, method, hook.__wrapped__)
            else:
                unwrap(_installed_on, method)
        _wrapped_methods.clear()
        _shutdown_grace.uninstall()
        _signal_wake.uninstall()
        _installed_on = None
    _runtime.shutdown()
