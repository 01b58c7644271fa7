"""Per-request spans: one span per finished request that had drafts.

Off unless ``OTEL_SPECDEC_TRACES=true``. The scheduler's thread only hands
a finished request's detail (already tallied by the accounting) to a queue;
a worker thread builds the span, in the trace the client sent to vLLM
(W3C ``traceparent`` in the request's trace headers), and links the
per-request acceptance-rate histogram to it with an exemplar. No SDK call
runs per step, and none on the scheduler's thread.

The trace headers reach the engine only when vLLM forwards them: the
OpenAI server does so only with its own tracing on
(``--otlp-traces-endpoint``); the offline ``LLMEngine.add_request`` always
does. Requests without a trace context start a new trace, subject to the
configured sampler (``OTEL_TRACES_SAMPLER``, parent-based by default).

The tracer provider: one given to ``instrument(tracer_provider=...)``, else
the global SDK one (``opentelemetry-instrument``), else the plugin's own,
built from ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ``none``) and
the ``OTEL_EXPORTER_OTLP_[TRACES_]*`` settings, which the OTLP exporter
reads itself.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_specdec import _instruments as names
from otel_specdec import environment_variables as env_vars
from otel_specdec._bounded import Deadline, call_within
from otel_specdec._settings import (
    PROTOCOLS,
    SHUTDOWN_TIMEOUT_ENV,
    ConfigError,
    env_flag,
    env_value,
    otlp_setting,
    otlp_timeout_s,
)
from otel_specdec.version import __version__

__all__ = [
    "ENABLE_ENV",
    "RequestSpanEmitter",
    "build_emitter",
    "configure",
    "enabled",
]

_logger = logging.getLogger(__name__)

ENABLE_ENV = env_vars.OTEL_SPECDEC_TRACES
TRACE_EXPORTERS = ("otlp", "console", "none")
# Finished requests waiting for their span; beyond this they are dropped
# (counted, logged once) rather than growing memory.
MAX_PENDING = 10_000

_configured_provider: TracerProvider | None = None


def configure(tracer_provider: Any | None) -> None:
    """Use ``tracer_provider`` (from ``instrument(tracer_provider=...)``)."""
    global _configured_provider
    if tracer_provider is not None and not isinstance(tracer_provider, TracerProvider):
        _logger.warning("otel_specdec: tracer_provider %r is not an OpenTelemetry SDK "
                        "TracerProvider; ignoring it", type(tracer_provider).__name__)
        tracer_provider = None
    _configured_provider = tracer_provider


def enabled(report: bool = True) -> bool:
    return env_flag(ENABLE_ENV, False, "request spans are off", report)


def _exporters() -> list[str]:
    raw = env_value(env_vars.OTEL_TRACES_EXPORTER) or "otlp"
    chosen = [name.strip().lower() for name in raw.split(",") if name.strip()]
    for name in chosen:
        if name not in TRACE_EXPORTERS:
            raise ConfigError(env_vars.OTEL_TRACES_EXPORTER, repr(raw),
                              " or ".join(TRACE_EXPORTERS))
    return [name for name in chosen if name != "none"]


def _span_exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = otlp_setting("PROTOCOL", "TRACES")
    if protocol is not None and protocol[1] not in PROTOCOLS:
        raise ConfigError(protocol[0], repr(protocol[1]), " or ".join(PROTOCOLS))
    if protocol is None or protocol[1] == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    # The timeout is passed explicitly: see otlp_timeout_s for its unit.
    return OTLPSpanExporter(timeout=otlp_timeout_s("TRACES"))


def _own_provider(resource: Resource) -> TracerProvider | None:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_span_exporter(name) for name in _exporters()]
    if not exporters:
        return None
    # The sampler comes from OTEL_TRACES_SAMPLER[_ARG] (parent-based
    # always-on by default), as the SDK reads it.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class RequestSpanEmitter:
    """Builds request spans on its own thread from what the scheduler hands over."""

    def __init__(self, provider: TracerProvider, owns_provider: bool) -> None:
        self.provider = provider
        self.owns_provider = owns_provider
        self._tracer = provider.get_tracer(names.TRACER_NAME, __version__)
        self._propagator = TraceContextTextMapPropagator()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._dropped = 0
        self._failed = False
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="otel-specdec-spans",
                                         daemon=True)
        self._thread.start()

    # --- the scheduler's thread -------------------------------------------

    def submit(self, request: Any, detail: Any, totals: Any) -> None:
        """Queue one finished request (no SDK call here)."""
        if self._failed:
            return
        if self._queue.qsize() >= MAX_PENDING:
            self._dropped += 1
            if self._dropped == 1:
                _logger.warning("otel_specdec: more than %d finished requests wait for their "
                                "span; dropping spans until the backlog clears", MAX_PENDING)
            return
        finished_reason = getattr(request, "get_finished_reason", None)
        reason = finished_reason() if finished_reason is not None else None
        self._queue.put((getattr(request, "trace_headers", None),
                         str(reason) if reason is not None else None,
                         detail, totals, time.time_ns()))

    # --- the worker thread ----------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):  # a flush waits for this point
                item.set()
                continue
            if self._failed:
                continue
            try:
                self._emit(*item)
            except Exception:
                self._failed = True
                _logger.exception("otel_specdec: internal error while building a request "
                                  "span; request spans are off in this process")

    def _emit(self, headers: Any, reason: str | None, detail: Any, totals: Any,
              end_ns: int) -> None:
        k = totals.num_speculative_tokens
        drafted_pos, accepted_pos = detail.per_position(k)
        drafts, drafted, accepted = detail.drafts, detail.drafted, detail.accepted
        rate = accepted / drafted
        attributes: dict[str, Any] = {
            **totals.attributes,
            names.SPAN_DRAFTS: drafts,
            names.SPAN_DRAFT_TOKENS: drafted,
            names.SPAN_ACCEPTED_TOKENS: accepted,
            names.SPAN_ACCEPTANCE_RATE: rate,
            names.SPAN_MEAN_ACCEPTANCE_LENGTH: 1 + accepted / drafts,
            names.SPAN_DRAFT_TOKENS_PER_POSITION: drafted_pos,
            names.SPAN_ACCEPTED_TOKENS_PER_POSITION: accepted_pos,
        }
        if reason is not None:
            attributes[names.SPAN_FINISH_REASONS] = [reason]
        parent = self._propagator.extract(dict(headers)) if headers else None
        span = self._tracer.start_span(
            names.SPAN_REQUEST, context=parent, kind=trace.SpanKind.INTERNAL,
            attributes=attributes, start_time=detail.first_ns,
        )
        span.end(end_time=end_ns)
        context = span.get_span_context()
        if context.trace_flags.sampled:
            totals.record_exemplar(rate, end_ns, context.trace_id, context.span_id)

    # --- shutdown -----------------------------------------------------------

    def flush(self, deadline: Deadline) -> None:
        """Build what is queued and export it, before ``deadline``."""
        self._drain(deadline, stop=False)

    def close(self, deadline: Deadline) -> None:
        """Flush, stop the worker, shut the plugin's own provider down."""
        self._drain(deadline, stop=True)

    def _drain(self, deadline: Deadline, stop: bool) -> None:
        # Half of what is left for building the queued spans, the rest (and
        # whatever building left over) for exporting them.
        if os.getpid() == self._pid and self._thread.is_alive():
            if stop:
                self._queue.put(None)
                self._thread.join(timeout=deadline.remaining_s() / 2)
            else:
                reached = threading.Event()
                self._queue.put(reached)
                reached.wait(timeout=deadline.remaining_s() / 2)

        def export() -> None:
            self.provider.force_flush(timeout_millis=int(deadline.remaining_s() * 1000))
            if stop and self.owns_provider:
                self.provider.shutdown()

        if not call_within(export, deadline.remaining_s(), "span-export"):
            _logger.warning(
                "otel_specdec: request spans were not all exported within the shutdown "
                "budget (%s=%g s); the engine stops without waiting longer",
                SHUTDOWN_TIMEOUT_ENV, deadline.budget_s)


def build_emitter(resource: Resource) -> RequestSpanEmitter | None:
    """The process's span emitter, or None when request spans are off.

    A bad trace setting gives one line naming it; spans stay off and the
    metrics go on.
    """
    if not enabled():
        return None
    provider = _configured_provider
    if provider is None:
        global_provider = trace.get_tracer_provider()
        if isinstance(global_provider, TracerProvider):
            provider = global_provider
    owns = False
    if provider is None:
        try:
            provider = _own_provider(resource)
        except ConfigError as exc:
            _logger.error("otel_specdec: %s; request spans are off, metrics go on", exc)
            return None
        except Exception as exc:
            _logger.error("otel_specdec: the span exporter could not be built (%s); request "
                          "spans are off, metrics go on", exc)
            return None
        if provider is None:
            _logger.info("otel_specdec: OTEL_TRACES_EXPORTER=none, request spans are off")
            return None
        owns = True
    return RequestSpanEmitter(provider, owns)
