"""Choose or build the MeterProvider, from the standard ``OTEL_*`` settings.

An SDK ``MeterProvider`` that the process already has (given to
``instrument(meter_provider=...)``, or installed globally by
``opentelemetry-instrument`` or the user's code) is used as it is. Otherwise
the plugin builds a private one per engine process, configured the way the
OpenTelemetry SDK documents: ``OTEL_METRICS_EXPORTER``, the
``OTEL_EXPORTER_OTLP_[METRICS_]*`` settings (read by the OTLP exporters
themselves), ``OTEL_METRIC_EXPORT_INTERVAL``/``_TIMEOUT``,
``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource

from otel_specdec import environment_variables as env_vars
from otel_specdec._instruments import RES_DP_RANK
from otel_specdec._settings import ExportSettings, env_value

__all__ = ["DeliveryRecord", "build_meter_provider", "existing_sdk_provider"]

_logger = logging.getLogger(__name__)


class DeliveryRecord:
    """When each of the plugin's push exporters last delivered an export.

    The SDK's reader drops an export's result; the shutdown needs it, to
    say when the final export was not delivered (a reader may also end
    "in time" by abandoning an export it had in flight).
    """

    def __init__(self) -> None:
        self._last_success: dict[int, float] = {}
        self._lock = threading.Lock()

    def watch(self, exporter: Any) -> Any:
        """``exporter``, its exports recorded (an instance attribute
        shadows its ``export``; nothing else of it changes)."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        export = exporter.export
        key = id(exporter)
        with self._lock:
            self._last_success[key] = float("-inf")

        def export_and_record(*args: Any, **kwargs: Any) -> Any:
            began = time.monotonic()
            result = export(*args, **kwargs)
            if result == MetricExportResult.SUCCESS:
                with self._lock:
                    self._last_success[key] = max(self._last_success[key], began)
            return result

        exporter.export = export_and_record
        return exporter

    def delivered_since(self, moment: float) -> bool:
        """Every exporter delivered an export collected after ``moment``."""
        with self._lock:
            return all(last >= moment for last in self._last_success.values())

def _otlp_exporter(settings: ExportSettings) -> Any:
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter,
        )
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter,
        )
        if _http_ca_file_configured():
            from otel_specdec._http_session import CaPinnedSession

            # The CA file must win over REQUESTS_CA_BUNDLE: see _http_session.
            return OTLPMetricExporter(timeout=settings.otlp_timeout_s, session=CaPinnedSession())
    # The timeout is passed explicitly: it was checked, and the shutdown
    # budget is derived from it. Everything else the exporter reads itself.
    return OTLPMetricExporter(timeout=settings.otlp_timeout_s)


def _http_ca_file_configured() -> bool:
    """A CA file is set and no credential provider supplies its own session."""
    has_ca = any(env_value(name) for name in env_vars.otlp_variables("CERTIFICATE"))
    providers = env_vars.OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDERS
    return has_ca and not any(env_value(name) for name in providers)


def _prometheus_reader(settings: ExportSettings, data_parallel_rank: int) -> MetricReader:
    from otel_specdec._prometheus_reader import ServedPrometheusReader

    # One port per data-parallel engine process on a host.
    return ServedPrometheusReader(
        settings.prometheus_host, settings.prometheus_port + data_parallel_rank
    )


def _exporter(name: str, settings: ExportSettings) -> Any:
    if name == "otlp":
        return _otlp_exporter(settings)
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    return ConsoleMetricExporter()


def build_resource(data_parallel_rank: int) -> Resource:
    """Per-process identity: service.instance.id unique per process."""
    attributes: dict[str, Any] = {
        "service.instance.id": str(uuid.uuid4()),
        "process.pid": os.getpid(),
        RES_DP_RANK: data_parallel_rank,
    }
    env_attrs = env_value(env_vars.OTEL_RESOURCE_ATTRIBUTES) or ""
    env_keys = {pair.split("=", 1)[0].strip() for pair in env_attrs.split(",") if "=" in pair}
    if not env_value(env_vars.OTEL_SERVICE_NAME) and "service.name" not in env_keys:
        attributes["service.name"] = "vllm"
    # Settings from the environment win over the defaults above.
    for key in env_keys & set(attributes):
        del attributes[key]
    return Resource.create(attributes)


def build_meter_provider(
    settings: ExportSettings, data_parallel_rank: int, delivery: DeliveryRecord
) -> MeterProvider | None:
    """A private provider per ``settings``; None if metrics are off.
    ``delivery`` records what its push exporters deliver.

    Not shut down by the SDK's exit hook: the runtime shuts it down itself,
    once, within the shutdown budget (see ``_runtime``).
    """
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    if not settings.exporters:
        return None
    # The pull reader first: it may fail to bind its port, and nothing
    # else has started a thread yet.
    readers: list[MetricReader] = []
    if "prometheus" in settings.exporters:
        readers.append(_prometheus_reader(settings, data_parallel_rank))
    try:
        readers += [
            PeriodicExportingMetricReader(
                delivery.watch(_exporter(name, settings)),
                export_interval_millis=settings.interval_ms,
                export_timeout_millis=settings.export_timeout_ms,
            )
            for name in settings.exporters if name != "prometheus"
        ]
    except Exception:
        for reader in readers:
            reader.shutdown()
        raise
    return MeterProvider(
        metric_readers=readers, resource=build_resource(data_parallel_rank),
        shutdown_on_exit=False,
    )


def existing_sdk_provider() -> MeterProvider | None:
    """The global provider if it is an SDK one (not the API's no-op/proxy)."""
    provider = metrics.get_meter_provider()
    return provider if isinstance(provider, MeterProvider) else None
