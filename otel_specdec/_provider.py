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
import uuid
from typing import Any

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource

from otel_specdec._instruments import RES_DP_RANK

__all__ = ["ConfigError", "build_meter_provider", "existing_sdk_provider", "readers_of"]

_logger = logging.getLogger(__name__)

_PROTOCOLS = ("grpc", "http/protobuf")
_EXPORTERS = ("otlp", "console", "none")
_DEFAULT_PROTOCOL = "grpc"


class ConfigError(ValueError):
    """A setting has a value the plugin cannot use."""

    def __init__(self, variable: str, value: str, expected: str) -> None:
        super().__init__(f"{variable}={value!r} is not valid: expected {expected}")
        self.variable = variable


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def metrics_exporters() -> list[str]:
    raw = _env("OTEL_METRICS_EXPORTER") or "otlp"
    chosen = [name.strip().lower() for name in raw.split(",") if name.strip()]
    for name in chosen:
        if name not in _EXPORTERS:
            raise ConfigError("OTEL_METRICS_EXPORTER", raw, " or ".join(_EXPORTERS))
    return [name for name in chosen if name != "none"]


def otlp_protocol() -> str:
    for variable in ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = _env(variable)
        if value is not None:
            if value not in _PROTOCOLS:
                raise ConfigError(variable, value, " or ".join(_PROTOCOLS))
            return value
    return _DEFAULT_PROTOCOL


def _otlp_exporter() -> Any:
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter,
        )
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter,
        )
    return OTLPMetricExporter()


def _exporter(name: str) -> Any:
    if name == "otlp":
        return _otlp_exporter()
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    return ConsoleMetricExporter()


def build_resource(data_parallel_rank: int) -> Resource:
    """Per-process identity: service.instance.id unique per process."""
    attributes: dict[str, Any] = {
        "service.instance.id": str(uuid.uuid4()),
        "process.pid": os.getpid(),
        RES_DP_RANK: data_parallel_rank,
    }
    env_attrs = _env("OTEL_RESOURCE_ATTRIBUTES") or ""
    env_keys = {pair.split("=", 1)[0].strip() for pair in env_attrs.split(",") if "=" in pair}
    if not _env("OTEL_SERVICE_NAME") and "service.name" not in env_keys:
        attributes["service.name"] = "vllm"
    # Settings from the environment win over the defaults above.
    for key in env_keys & set(attributes):
        del attributes[key]
    return Resource.create(attributes)


def build_meter_provider(data_parallel_rank: int) -> MeterProvider | None:
    """A private provider per the environment; None if metrics are off."""
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    names = metrics_exporters()
    if not names:
        return None
    readers = [PeriodicExportingMetricReader(_exporter(name)) for name in names]
    return MeterProvider(metric_readers=readers, resource=build_resource(data_parallel_rank))


def existing_sdk_provider() -> MeterProvider | None:
    """The global provider if it is an SDK one (not the API's no-op/proxy)."""
    provider = metrics.get_meter_provider()
    return provider if isinstance(provider, MeterProvider) else None


def readers_of(provider: MeterProvider) -> list[MetricReader]:
    """The readers of an SDK provider (not public API: SDK >= 1.4x keeps them
    on the provider, earlier releases in its configuration)."""
    readers = getattr(provider, "_metric_readers", None)
    if readers is None:
        readers = getattr(getattr(provider, "_sdk_config", None), "metric_readers", None)
    return [r for r in readers or () if isinstance(r, MetricReader)]


def resource_of(provider: MeterProvider) -> Resource:
    config = getattr(provider, "_sdk_config", None)
    return getattr(config, "resource", None) or Resource.get_empty()
