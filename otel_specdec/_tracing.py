"""Per-request spans: one span per finished request that had drafts.

Off unless ``OTEL_SPECDEC_TRACES=true``. The accounting keeps each
request's detail where its counts are (the C pass's rows) and, when it
finishes, appends it to a bounded hand-over list; a worker thread takes
the list's contents a few times a second and builds the spans, in the trace the client sent to vLLM
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
import threading
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_specdec import _instruments as names
from otel_specdec import _vllm_compat
from otel_specdec import environment_variables as env_vars
from otel_specdec._bounded import Deadline, call_within
from otel_specdec._request_details import DetailHandover, tail_sums, unpack_counts
from otel_specdec._settings import (
    PROTOCOLS,
    SHUTDOWN_TIMEOUT_ENV,
    ConfigError,
    env_flag,
    env_value,
    otlp_setting,
    otlp_timeout_s,
)
from otel_specdec._span_sampling import plan_for
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
# (logged once) rather than growing memory.
MAX_PENDING = 10_000
# How often the worker takes what the scheduler handed over (a flush wakes
# it at once): spans are built in batches, and the scheduler's thread never
# signals it.
POLL_S = 0.2
# While it finds nothing (no request finished with its span sampled, as with
# unsampled parents) it waits twice as long each time, up to this: each wake
# costs its thread about 0.1 ms of CPU and the scheduler's thread a GIL
# hand-off. Up to this much is handed over before the next wake.
IDLE_POLL_S = 1.6
# The longest the worker holds the GIL while building a batch of spans.
YIELD_S = 0.002
# At shutdown, the share of the budget for building the queued spans before
# the final metrics export (whose exemplars point at them); 10,000 queued
# spans take about half a second to build.
_BUILD_FIRST_SHARE = 0.25

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
    """Builds request spans on its own thread from what the scheduler hands over.

    The scheduler's thread only appends finished requests' detail to
    ``handover`` (``DetailHandover.hand_over``, on both paths); this thread takes it in
    batches (every ``POLL_S``, less often while there is nothing, or at once
    for a flush) and builds the spans.
    """

    def __init__(self, provider: TracerProvider, owns_provider: bool) -> None:
        self.provider = provider
        self.owns_provider = owns_provider
        self.handover = DetailHandover(plan_for(getattr(provider, "sampler", None)),
                                       MAX_PENDING)
        self._tracer = provider.get_tracer(names.TRACER_NAME, __version__)
        self._propagator = TraceContextTextMapPropagator()
        self._wake = threading.Event()
        self._flushes: list[threading.Event] = []
        self._stopping = False
        self._failed = False
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="otel-specdec-spans",
                                         daemon=True)
        if not self.handover.plan.keeps_none():  # else no span can be sampled: no work
            self._thread.start()

    def details_for_accounting(self) -> DetailHandover | None:
        """The hand-over for the accounting; None where no span can be sampled
        (the plan keeps no request's detail: the accounting runs as with spans off)."""
        return None if self.handover.plan.keeps_none() else self.handover

    # --- the worker thread ----------------------------------------------

    def _run(self) -> None:
        poll_s = POLL_S
        while True:
            self._wake.wait(poll_s)
            self._wake.clear()
            # Read before taking: what a flush or a stop waits for was handed
            # over before it asked.
            stopping = self._stopping
            flushes = self._flushes[:]
            held_since = time.perf_counter()
            items = self.handover.take()
            poll_s = POLL_S if items else min(2 * poll_s, IDLE_POLL_S)
            for item in items:
                if self._failed:
                    break
                try:
                    self._emit(*item)
                except Exception:
                    self._failed = True
                    _logger.exception("otel_specdec: internal error while building a request "
                                      "span; request spans are off in this process")
                # Let the GIL go every YIELD_S of spans: a scheduler step
                # waiting for it waits that long at most, not the
                # interpreter's switch interval (5 ms). Not after every span:
                # each hand-off costs more than a span.
                if time.perf_counter() - held_since > YIELD_S:
                    time.sleep(0)
                    held_since = time.perf_counter()
            for reached in flushes:
                self._flushes.remove(reached)
                reached.set()
            if stopping:
                for reached in self._flushes[:]:
                    reached.set()
                return

    def _emit(self, totals: Any, headers: Any, status: Any, first_ns: int, end_ns: int,
              packed_counts: bytes) -> None:
        accepted_counts, drafted_counts = unpack_counts(packed_counts)
        k = totals.num_speculative_tokens
        drafts = sum(accepted_counts)
        accepted = sum(a * c for a, c in enumerate(accepted_counts))
        drafted = sum(n * c for n, c in enumerate(drafted_counts))
        if not drafts or not drafted:
            return
        rate = accepted / drafted
        attributes: dict[str, Any] = {
            **totals.attributes,
            names.SPAN_DRAFTS: drafts,
            names.SPAN_DRAFT_TOKENS: drafted,
            names.SPAN_ACCEPTED_TOKENS: accepted,
            names.SPAN_ACCEPTANCE_RATE: rate,
            names.SPAN_MEAN_ACCEPTANCE_LENGTH: 1 + accepted / drafts,
            names.SPAN_DRAFT_TOKENS_PER_POSITION: tail_sums(drafted_counts, k),
            names.SPAN_ACCEPTED_TOKENS_PER_POSITION: tail_sums(accepted_counts, k),
            # Drafts by acceptance length 1..k+1 (accepted prefix plus the bonus token).
            names.SPAN_ACCEPTANCE_LENGTH_COUNTS: list(accepted_counts),
        }
        reason = _vllm_compat.finished_reason(status)
        if reason is not None:
            attributes[names.SPAN_FINISH_REASONS] = [reason]
        parent = self._propagator.extract(dict(headers)) if headers else None
        span = self._tracer.start_span(
            names.SPAN_REQUEST, context=parent, kind=trace.SpanKind.INTERNAL,
            attributes=attributes, start_time=first_ns,
        )
        span.end(end_time=end_ns)
        context = span.get_span_context()
        if context.trace_flags.sampled:
            totals.record_exemplar(rate, end_ns, context.trace_id, context.span_id)

    # --- shutdown -----------------------------------------------------------

    def build_queued(self, deadline: Deadline) -> None:
        """Let the worker build what was handed over, within a quarter of
        what is left of ``deadline``: the final metrics export then carries
        the exemplars that point at those spans."""
        self._wait_built(deadline.remaining_s() * _BUILD_FIRST_SHARE, stop=False)

    def flush(self, deadline: Deadline) -> None:
        """Build what is queued and export it, before ``deadline``."""
        self._drain(deadline, stop=False)

    def close(self, deadline: Deadline) -> None:
        """Flush, stop the worker, shut the plugin's own provider down."""
        self._drain(deadline, stop=True)

    def _wait_built(self, timeout_s: float, stop: bool) -> None:
        if os.getpid() == self._pid and self._thread.is_alive():
            reached = threading.Event()
            self._flushes.append(reached)
            self._stopping = self._stopping or stop
            self._wake.set()
            reached.wait(timeout=timeout_s)

    def _drain(self, deadline: Deadline, stop: bool) -> None:
        # Half of what is left for building the queued spans, the rest (and
        # whatever building left over) for exporting them.
        self._wait_built(deadline.remaining_s() / 2, stop)

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
