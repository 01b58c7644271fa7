"""Every environment variable the plugin reads, named once (as contrib
instrumentations keep ``environment_variables.py``). ``docs/configuration.md``
describes each; ``tests/test_environment_variables.py`` checks that no other
module names one itself.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "OTEL_EXPORTER_PROMETHEUS_HOST", "OTEL_EXPORTER_PROMETHEUS_PORT",
    "OTEL_METRICS_EXPORTER", "OTEL_METRIC_EXPORT_INTERVAL", "OTEL_METRIC_EXPORT_TIMEOUT",
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDERS", "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SERVICE_NAME", "OTEL_SPECDEC_ENABLED", "OTEL_SPECDEC_SHUTDOWN_TIMEOUT",
    "OTEL_SPECDEC_TRACES", "OTEL_TRACES_EXPORTER", "otlp_variables",
]

# --- The plugin's own ---------------------------------------------------

OTEL_SPECDEC_ENABLED: Final = "OTEL_SPECDEC_ENABLED"
"""``false`` keeps the plugin from loading through vLLM's plugin entry point."""

OTEL_SPECDEC_TRACES: Final = "OTEL_SPECDEC_TRACES"
"""``true`` turns per-request spans on (docs/traces.md)."""

OTEL_SPECDEC_SHUTDOWN_TIMEOUT: Final = "OTEL_SPECDEC_SHUTDOWN_TIMEOUT"
"""Seconds the plugin may spend at engine shutdown (final export, spans)."""

# --- OpenTelemetry's, read as the SDK reads them --------------------------

OTEL_METRICS_EXPORTER: Final = "OTEL_METRICS_EXPORTER"
OTEL_TRACES_EXPORTER: Final = "OTEL_TRACES_EXPORTER"
OTEL_METRIC_EXPORT_INTERVAL: Final = "OTEL_METRIC_EXPORT_INTERVAL"
OTEL_METRIC_EXPORT_TIMEOUT: Final = "OTEL_METRIC_EXPORT_TIMEOUT"
OTEL_EXPORTER_PROMETHEUS_HOST: Final = "OTEL_EXPORTER_PROMETHEUS_HOST"
OTEL_EXPORTER_PROMETHEUS_PORT: Final = "OTEL_EXPORTER_PROMETHEUS_PORT"
OTEL_RESOURCE_ATTRIBUTES: Final = "OTEL_RESOURCE_ATTRIBUTES"
OTEL_SERVICE_NAME: Final = "OTEL_SERVICE_NAME"
# The Python SDK's credential-provider hooks for OTLP/HTTP: where one is set,
# the plugin leaves the exporter's session to it.
OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDERS: Final = (
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_METRICS_CREDENTIAL_PROVIDER",
)

_OTLP_PREFIX: Final = "OTEL_EXPORTER_OTLP_"


def otlp_variables(setting: str, signal: str = "METRICS") -> tuple[str, str]:
    """The OTLP exporter variables for ``setting`` (``ENDPOINT``, ``TIMEOUT``,
    ...) and ``signal`` (``METRICS``, ``TRACES``): the signal's own, which
    wins, and the general one."""
    return f"{_OTLP_PREFIX}{signal}_{setting}", f"{_OTLP_PREFIX}{setting}"
