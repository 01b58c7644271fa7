"""``OTEL_METRICS_EXPORTER=prometheus``: the engine process serves /metrics.

For users without a collector. The OpenTelemetry Prometheus exporter
registers with prometheus_client's global registry and leaves its HTTP
server running for the life of the process; here each engine process gets
its own registry (only the plugin's metrics, never vLLM's or another
library's) and a server that stops with the meter provider.

Pull export has one limitation push does not: counts made after the last
scrape before the engine stops are never scraped.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, start_http_server

from otel_specdec import _sdk_compat
from otel_specdec import environment_variables as env_vars
from otel_specdec._settings import ConfigError

__all__ = ["ServedPrometheusReader"]


class ServedPrometheusReader(PrometheusMetricReader):  # type: ignore[misc]
    """A Prometheus reader with its own registry and /metrics server."""

    def __init__(self, host: str, port: int) -> None:
        registry = CollectorRegistry(auto_describe=True)
        # super().__init__(registry=registry), on exporters without that argument too.
        _sdk_compat.init_prometheus_reader(self, registry)
        self._served_registry = registry
        try:
            served = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            _sdk_compat.shutdown_prometheus_reader(self, registry, 30_000)
            raise ConfigError(
                env_vars.OTEL_EXPORTER_PROMETHEUS_PORT, str(port),
                f"a free port on {host} ({exc.strerror or exc})",
            ) from None
        # prometheus_client >= 0.20 returns (server, thread); earlier, None.
        self._server: Any = served[0] if isinstance(served, tuple) else None
        self.address = (host, port)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        _sdk_compat.shutdown_prometheus_reader(
            self, self._served_registry, timeout_millis, **kwargs
        )
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
