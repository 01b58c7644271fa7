"""OTLP collectors that fail the way real ones do, on loopback.

Each speaks the real protocol where the failure is a protocol answer (an
HTTP status, a gRPC status with its retry information), and real TCP where
it is a network failure (accept and never answer; reset every
connection). Every one counts what reached it, so a test can tell that the
exporter did try.

* ``hang``: accepts connections and never answers nor closes them.
* ``unavailable``: HTTP 503 / gRPC ``UNAVAILABLE``, forever.
* ``throttled``: HTTP 429 with ``Retry-After`` / gRPC ``RESOURCE_EXHAUSTED``
  with a ``RetryInfo`` delay, both an hour: longer than any budget.
* ``reset``: accepts and resets (RST) every connection at once.

``RecoveringCollector`` hangs until told to recover, then relays every new
connection to a real receiver. ``SlowCollector`` relays every connection
to a real receiver after a delay (a collector slow to answer).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KINDS = ("hang", "unavailable", "throttled", "reset")
RETRY_DELAY_S = 3600

_EXPORT_METHODS = (
    "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
    "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
)


class _TcpCollector:
    """A listening socket whose connections get ``on_accept``."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.connections = 0
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            self.on_accept(conn)

    def on_accept(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def start(self) -> _TcpCollector:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._sock.close()
        for conn in self.held:
            conn.close()


class _Hanging(_TcpCollector):
    def on_accept(self, conn: socket.socket) -> None:
        self.held.append(conn)  # never read, never answered, never closed


class _Resetting(_TcpCollector):
    def on_accept(self, conn: socket.socket) -> None:
        # Linger 0: close sends RST instead of FIN.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()


class _HttpStatus:
    """Answers every OTLP/HTTP export with one status."""

    def __init__(self, status: int) -> None:
        owner = self
        self.connections = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server name)
                owner.connections += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(status)
                if status == 429:
                    self.send_header("Retry-After", str(RETRY_DELAY_S))
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]

    def start(self) -> _HttpStatus:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _GrpcStatus:
    """Answers every OTLP/gRPC export with one status code."""

    def __init__(self, code_name: str) -> None:
        import grpc
        from google.protobuf.duration_pb2 import Duration
        from google.rpc.error_details_pb2 import RetryInfo

        code = getattr(grpc.StatusCode, code_name)
        retry_info = RetryInfo(retry_delay=Duration(seconds=RETRY_DELAY_S)).SerializeToString()
        owner = self
        self.connections = 0

        def export(request: bytes, context: Any) -> bytes:
            owner.connections += 1
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                context.set_trailing_metadata((("google.rpc.retryinfo-bin", retry_info),))
            context.abort(code, f"test collector: {code_name}")
            return b""

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: Any) -> Any:
                if details.method in _EXPORT_METHODS:
                    return grpc.unary_unary_rpc_method_handler(export)
                return None

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                   handlers=[Handler()])
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def start(self) -> _GrpcStatus:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)


class FaultyCollector:
    """One kind of failing collector for one OTLP protocol."""

    def __init__(self, kind: str, protocol: str) -> None:
        assert kind in KINDS, kind
        self.kind, self.protocol = kind, protocol
        grpc = protocol == "grpc"
        if kind == "hang":
            self._impl: Any = _Hanging()
        elif kind == "reset":
            self._impl = _Resetting()
        elif kind == "unavailable":
            self._impl = _GrpcStatus("UNAVAILABLE") if grpc else _HttpStatus(503)
        else:
            self._impl = _GrpcStatus("RESOURCE_EXHAUSTED") if grpc else _HttpStatus(429)
        self.endpoint = f"http://127.0.0.1:{self._impl.port}"

    @property
    def contacts(self) -> int:
        """Connections (TCP kinds) or export requests (status kinds) seen."""
        return self._impl.connections

    def __enter__(self) -> FaultyCollector:
        self._impl.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._impl.stop()

    def __repr__(self) -> str:
        return f"{self.kind}-{self.protocol}"


class RecoveringCollector(_TcpCollector):
    """Hangs every connection until ``recover()``; from then on relays each
    new connection to ``target_port`` (a real receiver).

    ``open_connections`` is how many client connections are open at once;
    its maximum while hanging shows whether exports pile up.
    """

    def __init__(self, target_port: int) -> None:
        super().__init__()
        self.target_port = target_port
        self.recovered = threading.Event()
        self.open_connections = 0
        self.max_open_while_hanging = 0
        self._lock = threading.Lock()

    def on_accept(self, conn: socket.socket) -> None:
        with self._lock:
            self.open_connections += 1
            if not self.recovered.is_set():
                self.max_open_while_hanging = max(self.max_open_while_hanging,
                                                  self.open_connections)
        if self.recovered.is_set():
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()
        else:
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _closed(self) -> None:
        with self._lock:
            self.open_connections -= 1

    def _hold(self, conn: socket.socket) -> None:
        """Read and discard until the client gives up; never answer."""
        with self._lock:
            self.held.append(conn)
        try:
            while conn.recv(65536):
                pass
        except OSError:
            pass
        finally:
            conn.close()
            self._closed()

    def _relay(self, conn: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target_port))

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        back = threading.Thread(target=pump, args=(upstream, conn), daemon=True)
        back.start()
        pump(conn, upstream)
        back.join()
        conn.close()
        upstream.close()
        self._closed()

    def recover(self) -> None:
        """Answer from now on; the hung connections end, as a collector
        that restarts ends them."""
        self.recovered.set()
        with self._lock:
            held, self.held = self.held, []
        for conn in held:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class SlowCollector(RecoveringCollector):
    """Relays each connection to ``target_port`` after ``delay_s``: every
    export is answered, ``delay_s`` late."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        super().__init__(target_port)
        self.delay_s = delay_s
        self.recovered.set()

    def _relay(self, conn: socket.socket) -> None:
        time.sleep(self.delay_s)
        super()._relay(conn)
