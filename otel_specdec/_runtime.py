"""Per-process state: the meter provider, the instruments and the totals.

Chosen once per process, lazily, when the first speculative scheduler is
built (so API-server and worker processes, which load the plugin too, never
start an exporter). Reset in a forked child, which must not report its
parent's totals.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource

from otel_specdec import _export_ledger, _provider, _sdk_compat, _tracing, _vllm_compat
from otel_specdec import environment_variables as env_vars
from otel_specdec._accounting import StepAccountant
from otel_specdec._bounded import Deadline, call_within
from otel_specdec._instruments import RES_DP_RANK
from otel_specdec._metrics_export import HistogramInjector, bind_counters
from otel_specdec._settings import (
    SHUTDOWN_TIMEOUT_ENV,
    ConfigError,
    ExportSettings,
    read_settings,
    shutdown_budget_s,
)
from otel_specdec._totals import TotalsRegistry
from otel_specdec._vllm_compat import EngineInfo

__all__ = [
    "Runtime",
    "configure",
    "current",
    "generation",
    "generation_now",
    "get_or_create",
    "shutdown",
]

_logger = logging.getLogger(__name__)


class Runtime:
    """The OpenTelemetry side of the plugin in one process.

    ``settings`` is None when the provider is not the plugin's own.
    """

    def __init__(self, provider: MeterProvider, settings: ExportSettings | None,
                 data_parallel_rank: int,
                 delivery: _provider.DeliveryRecord | None = None) -> None:
        self.provider = provider
        # What the plugin's own exporters delivered (None: not the plugin's).
        self.delivery = delivery
        self.settings = settings
        self.owns_provider = settings is not None
        self.registry = TotalsRegistry()
        self.closed = False
        # What the plugin may add to a stopping engine: metrics, then spans.
        self.shutdown_budget_s = (settings.shutdown_budget_s if settings is not None
                                  else shutdown_budget_s())
        self._live_engines = 0
        self._lock = threading.Lock()
        guard = bind_counters(provider, self.registry)
        identity = {"service.instance.id": str(uuid.uuid4()), RES_DP_RANK: data_parallel_rank}
        resource = _sdk_compat.provider_resource(provider)
        self.injector = HistogramInjector(
            self.registry, resource, guard, identity, self.owns_provider
        )
        readers = _sdk_compat.metric_readers(provider)
        if not readers:
            _logger.warning(
                "otel_specdec: the MeterProvider has no readers the plugin can see; "
                "the histograms %s are not exported", "(acceptance_length, request.acceptance_rate)"
            )
        for reader in readers:
            self.injector.attach(reader)
        missing = {k: v for k, v in identity.items() if k not in resource.attributes}
        self.spans = _tracing.build_emitter(resource.merge(Resource(missing)))

    def accountant_for(self, scheduler: Any, info: EngineInfo) -> StepAccountant:
        layout = _vllm_compat.host_layout()
        totals = self.registry.totals_for(info.attributes, info.num_speculative_tokens)
        with self._lock:
            self._live_engines += 1
        return StepAccountant(
            totals,
            scheduler.requests,
            num_sampled_per_step=info.num_sampled_per_step,
            track_padding=not info.async_scheduling,
            steps_in_flight=info.steps_in_flight,
            finished_above=_vllm_compat.finished_status_threshold(),
            details=self.spans.details_for_accounting() if self.spans is not None else None,
            fields=layout.fields,
            rules=layout.rules,
        )

    def engine_stopped(self) -> None:
        """An engine shut down: export what it counted, within the shutdown budget.

        The last engine of the plugin's own provider shuts the provider down
        (one final export); otherwise the provider is flushed.
        """
        with self._lock:
            self._live_engines -= 1
            last = self._live_engines <= 0
        if last and self.owns_provider:
            _discard(self)
        else:
            self.flush()

    def flush(self) -> None:
        if self.closed:
            return
        deadline = Deadline(self.shutdown_budget_s)
        if self.spans is not None:
            self.spans.build_queued(deadline)
        began = self._export_began("flush")
        done = call_within(
            lambda: self.provider.force_flush(timeout_millis=_millis(deadline)),
            deadline.remaining_s(), "metrics-flush",
        )
        _export_ledger.settle()
        self._check_delivered(done, began, deadline, "flush")
        if self.spans is not None:
            self.spans.flush(deadline)

    def close(self) -> None:
        """Stop reporting; shut the plugin's own provider down (final export).

        Everything here ends within the shutdown budget, whatever the
        exporters' timeouts or the collector do.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
        deadline = Deadline(self.shutdown_budget_s)
        if self.spans is not None:
            # Spans built first: the final export's exemplars point at them.
            self.spans.build_queued(deadline)
        if self.owns_provider:
            began = self._export_began("export")
            done = call_within(
                lambda: self.provider.shutdown(timeout_millis=_millis(deadline)),
                deadline.remaining_s(), "metrics-shutdown",
            )
            # Settled before the warning: a line says what was lost either
            # here or, if the engine is killed before this, in its front end.
            _export_ledger.settle()
            self._check_delivered(done, began, deadline, "export")
        else:
            bind_counters(self.provider, None)
            _export_ledger.settle()
        self.injector.detach_all()
        # Metrics first: they are the complete record; spans are samples.
        if self.spans is not None:
            self.spans.close(deadline)

    def _export_began(self, what: str) -> float:
        _logger.debug("otel_specdec: final metrics %s began (%d data points, budget %g s)",
                      what, self.registry.data_points(), self.shutdown_budget_s)
        return time.monotonic()

    def _check_delivered(self, done: bool, began: float, deadline: Deadline, what: str) -> None:
        """One warning when the final export did not reach the collector."""
        if done and (self.delivery is None or self.delivery.delivered_since(began)):
            _logger.debug("otel_specdec: final metrics %s ended in %.3f s (%s)", what,
                          time.monotonic() - began,
                          "delivered" if self.delivery is not None else "the provider's owner's")
            return
        if not done or deadline.remaining_s() <= 0.05 * deadline.budget_s:
            cause = (f"was cut short by the shutdown budget ({SHUTDOWN_TIMEOUT_ENV}="
                     f"{self.shutdown_budget_s:g} s)")
        else:
            cause = "was not accepted by the collector (see the exporter's error)"
        _logger.warning(
            "otel_specdec: the final metrics %s %s: the latest values of %d data points were "
            "not delivered (what was counted since the last export that reached the "
            "collector is lost); the engine stops without waiting longer",
            what, cause, self.registry.data_points(),
        )


def _millis(deadline: Deadline) -> float:
    return deadline.remaining_s() * 1000.0


_lock = threading.Lock()
_runtime: Runtime | None = None
_disabled_reason: str | None = None
_configured_provider: MeterProvider | None = None
# Changes whenever the runtime is discarded, invalidating accountants (read
# directly by the step wrapper, which runs every step).
generation_now = 0


def generation() -> int:
    """``generation_now``."""
    return generation_now


def configure(meter_provider: Any | None) -> None:
    """Use ``meter_provider`` (from ``instrument(meter_provider=...)``)."""
    global _configured_provider
    if meter_provider is not None and not isinstance(meter_provider, MeterProvider):
        _logger.warning(
            "otel_specdec: meter_provider %r is not an OpenTelemetry SDK MeterProvider; "
            "ignoring it", type(meter_provider).__name__,
        )
        meter_provider = None
    _configured_provider = meter_provider


def current() -> Runtime | None:
    return _runtime


def get_or_create(info: EngineInfo) -> Runtime | None:
    """The process's runtime, built on first use; None when metrics are off."""
    global _runtime, _disabled_reason
    if _runtime is not None or _disabled_reason is not None:
        return _runtime
    with _lock:
        if _runtime is not None or _disabled_reason is not None:
            return _runtime
        provider = _configured_provider or _provider.existing_sdk_provider()
        settings = None
        delivery = None
        if provider is None:
            try:
                settings = read_settings()
                delivery = _provider.DeliveryRecord()
                provider = _provider.build_meter_provider(
                    settings, info.data_parallel_rank, delivery)
            except ConfigError as exc:
                return _disable_metrics(str(exc))
            except Exception as exc:  # an exporter rejecting what the checks let through
                return _disable_metrics(f"the exporter could not be built ({exc})")
            if provider is None:
                _disabled_reason = f"{env_vars.OTEL_METRICS_EXPORTER}=none"
                _logger.info("otel_specdec: %s, metrics are off", _disabled_reason)
                return None
        _runtime = Runtime(provider, settings, info.data_parallel_rank, delivery)
        _export_ledger.owe()
        if settings is not None:
            _register_exit_hook()
        return _runtime


def _disable_metrics(reason: str) -> None:
    global _disabled_reason
    _disabled_reason = reason
    _logger.error(
        "otel_specdec: %s; speculative-decoding metrics are disabled, the engine runs on",
        reason,
    )
    return None


_exit_hook_registered = False


def _register_exit_hook() -> None:
    """Close the runtime at interpreter exit if no engine shutdown did.

    Replaces the SDK's own exit hook on the plugin's provider, so that the
    provider is shut down once, within the shutdown budget.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(shutdown)


def _discard(runtime: Runtime) -> None:
    """Close ``runtime`` and forget it, if it is still the current one."""
    global _runtime, generation_now
    with _lock:
        if _runtime is runtime:
            _runtime = None
            generation_now += 1
    runtime.close()


def shutdown() -> None:
    """Close the runtime (uninstrument, exit); a later engine builds a new one."""
    global _runtime, _disabled_reason, generation_now
    with _lock:
        runtime, _runtime, _disabled_reason = _runtime, None, None
        generation_now += 1
    if runtime is not None:
        runtime.close()


def _reset_after_fork() -> None:
    global _runtime, _disabled_reason, _lock, generation_now
    _lock = threading.Lock()
    _runtime = None
    _disabled_reason = None
    generation_now += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
