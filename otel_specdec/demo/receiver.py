"""A small OTLP metrics and traces receiver on loopback (gRPC and HTTP/protobuf).

Used by ``otel-specdec demo`` to show what a collector would receive, and by
the tests as the real far end of the export. It keeps, per series (resource
+ metric + point attributes), the latest cumulative point, or the sum of
delta points, so totals can be compared with vLLM's own counters, and
every span received.
"""

from __future__ import annotations

import gzip
import ssl
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = [
    "HistogramTotal", "MetricsStore", "OtlpReceiver", "ReceivedSpan", "ServerTls", "SpanStore",
    "add_elementwise",
]

_DELTA = 1  # AGGREGATION_TEMPORALITY_DELTA


def _any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_any_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


def attributes_of(kvs: Any) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in kvs}


def add_elementwise(target: list[int], values: Any) -> None:
    """``target[i] += values[i]``, growing ``target`` as needed."""
    values = list(values)
    target.extend([0] * (len(values) - len(target)))
    for i, value in enumerate(values):
        target[i] += value


def _key(attrs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(attrs.items()))


@dataclass
class HistogramTotal:
    count: int = 0
    sum: float = 0.0
    bucket_counts: list[int] = field(default_factory=list)
    explicit_bounds: list[float] = field(default_factory=list)
    min: float | None = None
    max: float | None = None
    # (value, trace id hex, span id hex) of the exemplars of the last point.
    exemplars: list[tuple[float, str, str]] = field(default_factory=list)

    def merge(self, other: HistogramTotal) -> None:
        """Add ``other``'s counts (same bounds) into this total."""
        self.count += other.count
        self.sum += other.sum
        add_elementwise(self.bucket_counts, other.bucket_counts)
        self.explicit_bounds = other.explicit_bounds or self.explicit_bounds
        if other.min is not None:
            self.min = other.min if self.min is None else min(self.min, other.min)
        if other.max is not None:
            self.max = other.max if self.max is None else max(self.max, other.max)
        self.exemplars = other.exemplars or self.exemplars


@dataclass
class _Series:
    resource: dict[str, Any]
    scope: tuple[str, str]
    name: str
    unit: str
    kind: str
    attributes: dict[str, Any]
    value: Any = None
    # Temporality of the last point received (sums and histograms).
    delta: bool = False


class MetricsStore:
    """Series received so far, merged by temporality."""

    def __init__(self) -> None:
        # Reentrant: wait_for's predicate reads the store under the lock.
        self._lock = threading.RLock()
        self._series: dict[tuple[Any, ...], _Series] = {}
        self.requests = 0
        # Wall-clock time (time.time()) of each export request received.
        self.received_at: list[float] = []
        # (time.time(), error) of each request the store could not take:
        # the sender got an error back.
        self.refused: list[tuple[float, str]] = []
        self.changed = threading.Condition(self._lock)

    def ingest(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self._lock:
            self.requests += 1
            self.received_at.append(time.time())
            try:
                for rm in request.resource_metrics:
                    resource = attributes_of(rm.resource.attributes)
                    for sm in rm.scope_metrics:
                        scope = (sm.scope.name, sm.scope.version)
                        for metric in sm.metrics:
                            self._ingest_metric(resource, scope, metric)
            except Exception as exc:
                self.refused.append((time.time(), repr(exc)))
                raise
            finally:
                self.changed.notify_all()

    def _ingest_metric(self, resource: dict[str, Any], scope: tuple[str, str], metric: Any) -> None:
        kind = metric.WhichOneof("data")
        if kind in ("sum", "gauge"):
            data = getattr(metric, kind)
            delta = kind == "sum" and data.aggregation_temporality == _DELTA
            for point in data.data_points:
                value = point.as_int if point.WhichOneof("value") == "as_int" else point.as_double
                series = self._get(resource, scope, metric, kind, point)
                series.value = (series.value or 0) + value if delta else value
                series.delta = delta
        elif kind == "histogram":
            delta = metric.histogram.aggregation_temporality == _DELTA
            for point in metric.histogram.data_points:
                series = self._get(resource, scope, metric, kind, point)
                if not delta or series.value is None:
                    series.value = HistogramTotal()
                series.delta = delta
                series.value.merge(HistogramTotal(
                    point.count, point.sum, list(point.bucket_counts),
                    list(point.explicit_bounds),
                    point.min if point.HasField("min") else None,
                    point.max if point.HasField("max") else None,
                    [(e.as_double, e.trace_id.hex(), e.span_id.hex()) for e in point.exemplars],
                ))

    def _get(self, resource: dict[str, Any], scope: tuple[str, str], metric: Any,
             kind: str, point: Any) -> _Series:
        attrs = attributes_of(point.attributes)
        key = (_key(resource), scope, metric.name, _key(attrs))
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(
                resource, scope, metric.name, metric.unit, kind, attrs
            )
        return series

    def series(self, name: str | None = None,
               resource: dict[str, Any] | None = None) -> list[_Series]:
        """Series named ``name`` whose resource has the ``resource`` attributes."""
        with self._lock:
            return [s for s in self._series.values() if (name is None or s.name == name)
                    and all(s.resource.get(k) == v for k, v in (resource or {}).items())]

    def counter_total(self, name: str, resource: dict[str, Any] | None = None,
                      **match: Any) -> int | float:
        return sum(
            s.value for s in self.series(name, resource)
            if all(s.attributes.get(k) == v for k, v in match.items())
        )

    def by_attribute(self, name: str, attribute: str,
                     resource: dict[str, Any] | None = None) -> dict[Any, int | float]:
        out: dict[Any, int | float] = {}
        for s in self.series(name, resource):
            key = s.attributes.get(attribute)
            out[key] = out.get(key, 0) + s.value
        return out

    def spec_decode_totals(self, resource: dict[str, Any] | None = None) -> dict[str, Any]:
        """The totals comparable with vLLM's own counters (``engine_run.vllm_counters``),
        of the series whose resource has the ``resource`` attributes."""
        per_pos = self.by_attribute("vllm.spec_decode.accepted_tokens",
                                    "vllm.spec_decode.position", resource)
        return {
            "drafts": self.counter_total("vllm.spec_decode.drafts", resource),
            "draft_tokens": self.counter_total("vllm.spec_decode.draft_tokens", resource),
            "accepted_tokens": self.counter_total("vllm.spec_decode.accepted_tokens", resource),
            "accepted_per_pos": [per_pos[p] for p in sorted(per_pos)],
        }

    def histogram_total(self, name: str) -> HistogramTotal:
        merged = HistogramTotal()
        for s in self.series(name):
            merged.merge(s.value)
        return merged

    def wait_for(self, predicate: Any, timeout: float) -> bool:
        with self._lock:
            return self.changed.wait_for(lambda: _safe(predicate), timeout=timeout)


def _safe(predicate: Any) -> bool:
    try:
        return bool(predicate())
    except (KeyError, TypeError, AttributeError):
        return False


@dataclass
class ReceivedSpan:
    resource: dict[str, Any]
    scope: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


class SpanStore:
    """Every span received, in arrival order."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._spans: list[ReceivedSpan] = []
        self.changed = threading.Condition(self._lock)

    def ingest(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            for rs in request.resource_spans:
                resource = attributes_of(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self._spans.append(ReceivedSpan(
                            resource, ss.scope.name, span.name, span.trace_id.hex(),
                            span.span_id.hex(), span.parent_span_id.hex(), span.kind,
                            span.start_time_unix_nano, span.end_time_unix_nano,
                            attributes_of(span.attributes)))
            self.changed.notify_all()

    def spans(self, name: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if name is None or s.name == name]

    def wait_for(self, predicate: Any, timeout: float) -> bool:
        with self._lock:
            return self.changed.wait_for(lambda: _safe(predicate), timeout=timeout)


class _GrpcTraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: SpanStore) -> None:
        self._store = store

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        self._store.ingest(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _GrpcService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, store: MetricsStore) -> None:
        self._store = store

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        self._store.ingest(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _http_handler(store: MetricsStore, spans: SpanStore) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            encoding = (self.headers.get("Content-Encoding") or "").lower()
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            path = self.path.rstrip("/")
            if path == "/v1/metrics":
                request: Any = metrics_service_pb2.ExportMetricsServiceRequest()
                request.ParseFromString(body)
                store.ingest(request)
                payload = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
            elif path == "/v1/traces":
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                spans.ingest(request)
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@dataclass(frozen=True)
class ServerTls:
    """PEM files for a TLS receiver; with ``client_ca``, client certificates
    signed by it are required (mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class OtlpReceiver:
    """OTLP/gRPC and OTLP/HTTP metrics and traces endpoints on loopback.

    Ports are free ones unless given (a test restarting a "collector" on
    the same address gives them); ``store`` may be shared across restarts.
    """

    def __init__(self, host: str = "127.0.0.1", *, grpc_port: int = 0, http_port: int = 0,
                 tls: ServerTls | None = None, store: MetricsStore | None = None) -> None:
        self.host = host
        self.store = store or MetricsStore()
        self.spans = SpanStore()
        self.tls = tls
        self._grpc: Any = None
        self._http: ThreadingHTTPServer | None = None
        self.grpc_port = grpc_port
        self.http_port = http_port

    def start(self) -> OtlpReceiver:
        import grpc

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _GrpcService(self.store), self._grpc
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _GrpcTraceService(self.spans), self._grpc
        )
        address = f"{self.host}:{self.grpc_port}"
        if self.tls is None:
            self.grpc_port = self._grpc.add_insecure_port(address)
        else:
            client_ca = _read(self.tls.client_ca_file) if self.tls.client_ca_file else None
            credentials = grpc.ssl_server_credentials(
                [(_read(self.tls.key_file), _read(self.tls.cert_file))],
                root_certificates=client_ca, require_client_auth=client_ca is not None,
            )
            self.grpc_port = self._grpc.add_secure_port(address, credentials)
        self._grpc.start()
        ThreadingHTTPServer.allow_reuse_address = True
        self._http = ThreadingHTTPServer(
            (self.host, self.http_port), _http_handler(self.store, self.spans)
        )
        if self.tls is not None:
            self._http.socket = self._server_ssl_context().wrap_socket(
                self._http.socket, server_side=True
            )
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def _server_ssl_context(self) -> ssl.SSLContext:
        assert self.tls is not None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
        if self.tls.client_ca_file:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self.tls.client_ca_file)
        return context

    def endpoint(self, protocol: str) -> str:
        port = self.grpc_port if protocol == "grpc" else self.http_port
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{port}"

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

