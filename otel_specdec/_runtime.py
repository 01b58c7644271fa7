"""Per-process state: the meter provider, the instruments and the totals.

Chosen once per process, lazily, when the first speculative scheduler is
built (so API-server and worker processes, which load the plugin too, never
start an exporter). Reset in a forked child, which must not report its
parent's totals.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider

from otel_specdec import _provider, _vllm_compat
from otel_specdec._accounting import StepAccountant
from otel_specdec._instruments import METER_NAME
from otel_specdec._metrics_export import HistogramInjector, TotalsRegistry, register_counters
from otel_specdec._vllm_compat import EngineInfo
from otel_specdec.version import __version__

__all__ = ["Runtime", "configure", "current", "get_or_create", "shutdown"]

_logger = logging.getLogger(__name__)

# Flush budget at engine shutdown; the exporter's own timeout bounds each try.
_FLUSH_TIMEOUT_MILLIS = 10_000


class Runtime:
    """The OpenTelemetry side of the plugin in one process."""

    def __init__(self, provider: MeterProvider, owns_provider: bool) -> None:
        self.provider = provider
        self.owns_provider = owns_provider
        self.registry = TotalsRegistry()
        self.injector = HistogramInjector(self.registry, _provider.resource_of(provider))
        meter = provider.get_meter(METER_NAME, __version__)
        register_counters(meter, self.registry)
        readers = _provider.readers_of(provider)
        if not readers:
            _logger.warning(
                "otel_specdec: the MeterProvider has no readers the plugin can see; "
                "the histograms %s are not exported", "(acceptance_length, request.acceptance_rate)"
            )
        for reader in readers:
            self.injector.attach(reader)

    def accountant_for(self, scheduler: Any, info: EngineInfo) -> StepAccountant:
        totals = self.registry.totals_for(info.attributes, info.num_speculative_tokens)
        return StepAccountant(
            totals,
            scheduler.requests,
            num_sampled_per_step=info.num_sampled_per_step,
            track_padding=not info.async_scheduling,
            steps_in_flight=info.steps_in_flight,
            finished_above=_vllm_compat.finished_status_threshold(),
        )

    def flush(self) -> None:
        try:
            self.provider.force_flush(timeout_millis=_FLUSH_TIMEOUT_MILLIS)
        except Exception:
            _logger.warning("otel_specdec: flushing metrics failed", exc_info=True)

    def close(self) -> None:
        self.injector.detach_all()
        if self.owns_provider:
            try:
                self.provider.shutdown(timeout_millis=_FLUSH_TIMEOUT_MILLIS)
            except Exception:
                _logger.warning("otel_specdec: shutting down metrics failed", exc_info=True)


_lock = threading.Lock()
_runtime: Runtime | None = None
_disabled_reason: str | None = None
_configured_provider: MeterProvider | None = None
_generation = 0


def generation() -> int:
    """Changes whenever the runtime is discarded, invalidating accountants."""
    return _generation


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
        owns = provider is None
        if owns:
            try:
                provider = _provider.build_meter_provider(info.data_parallel_rank)
            except _provider.ConfigError as exc:
                _disabled_reason = str(exc)
                _logger.error(
                    "otel_specdec: %s; speculative-decoding metrics are disabled, "
                    "the engine runs on", exc,
                )
                return None
            if provider is None:
                _disabled_reason = "OTEL_METRICS_EXPORTER=none"
                _logger.info("otel_specdec: OTEL_METRICS_EXPORTER=none, metrics are off")
                return None
        _runtime = Runtime(provider, owns_provider=owns)
        return _runtime


def shutdown() -> None:
    """Close the runtime (uninstrument); a later engine builds a new one."""
    global _runtime, _disabled_reason, _generation
    with _lock:
        runtime, _runtime, _disabled_reason = _runtime, None, None
        _generation += 1
    if runtime is not None:
        runtime.close()


def _reset_after_fork() -> None:
    global _runtime, _disabled_reason, _lock, _generation
    _lock = threading.Lock()
    _runtime = None
    _disabled_reason = None
    _generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
