"""Hand the accounting's totals to OpenTelemetry, off the hot path.

Counters are observable instruments whose callbacks read the totals when a
reader collects. Histograms cannot be fed pre-aggregated bucket counts
through the OpenTelemetry API (``Histogram.record`` takes one value, and one
call per draft would cost seconds of CPU per minute at production batch
sizes), so their data points are built here from the bucket counts and added
to each collection of the meter provider's readers, by hooking each
reader's ``_receive_metrics`` (the hook every SDK reader implements; see
``_sdk_compat``). Their cost per collection depends on the number of
series, not on the number of drafts recorded.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import Exemplar
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_specdec import _instruments as names
from otel_specdec import _sdk_compat
from otel_specdec._totals import SpecDecodeTotals, TotalsRegistry, TotalsSnapshot
from otel_specdec.version import __version__

__all__ = ["ExportGuard", "HistogramInjector", "bind_counters"]

_logger = logging.getLogger(__name__)


def _with_position(attributes: dict[str, Any], position: int) -> dict[str, Any]:
    return {**attributes, names.ATTR_POSITION: position}


class ExportGuard:
    """Stops the plugin's export for good after its first failure.

    A bug in the plugin's collection code must not make the SDK log an
    error at every collection: the first failure is logged with its
    traceback, then the plugin contributes nothing more to exports.
    """

    def __init__(self) -> None:
        self.failed = False

    def trip(self, where: str) -> None:
        if not self.failed:
            self.failed = True
            _logger.exception(
                "otel_specdec: internal error while %s; the plugin stops exporting "
                "speculative-decoding metrics in this process, vLLM is unaffected", where,
            )


class _CounterSource:
    """What a provider's observable counters read: the current runtime's totals."""

    def __init__(self) -> None:
        self.registry: TotalsRegistry | None = None
        self.guard = ExportGuard()

    def observations(self, observe: Callable[[SpecDecodeTotals], Iterable[Observation]],
                     name: str) -> list[Observation]:
        registry, guard = self.registry, self.guard
        if registry is None or guard.failed:
            return []
        try:
            return [obs for entry in registry.entries() for obs in observe(entry)]
        except Exception:
            guard.trip(f"reading {name}")
            return []


# Instruments are created once per provider (the SDK ignores a second
# creation under the same name, callbacks included); a new runtime on the
# same provider (re-instrumented, or in a forked child) rebinds the source.
_counter_sources: weakref.WeakKeyDictionary[Any, _CounterSource] = weakref.WeakKeyDictionary()
_sources_lock = threading.Lock()


def _drafts(entry: SpecDecodeTotals) -> Iterable[Observation]:
    yield Observation(sum(entry.accepted_hist), entry.attributes)


def _per_position(accepted: bool) -> Callable[[SpecDecodeTotals], Iterable[Observation]]:
    def observe(entry: SpecDecodeTotals) -> Iterable[Observation]:
        snap = entry.snapshot()
        k = entry.num_speculative_tokens
        values = snap.accepted_per_position(k) if accepted else snap.drafted_per_position(k)
        for position, value in enumerate(values):
            yield Observation(value, _with_position(entry.attributes, position))

    return observe


def _scalar(field: str) -> Callable[[SpecDecodeTotals], Iterable[Observation]]:
    def observe(entry: SpecDecodeTotals) -> Iterable[Observation]:
        yield Observation(getattr(entry, field), entry.attributes)

    return observe


# How each counter of the contract (names.METRICS) is read from the totals.
_COUNTER_SOURCES = {
    names.DRAFTS: _drafts,
    names.DRAFT_TOKENS: _per_position(accepted=False),
    names.ACCEPTED_TOKENS: _per_position(accepted=True),
    names.EMPTY_PROPOSALS: _scalar("empty_proposals"),
    names.PADDING_TOKENS: _scalar("padding_tokens"),
}


def bind_counters(provider: Any, registry: TotalsRegistry | None) -> ExportGuard:
    """Make ``provider``'s counters report ``registry`` (None: report nothing)."""
    with _sources_lock:
        source = _counter_sources.get(provider)
        if source is None:
            source = _counter_sources[provider] = _CounterSource()
            meter = provider.get_meter(names.METER_NAME, __version__)
            for spec in names.METRICS:
                if spec.instrument != names.COUNTER:
                    continue  # histograms: added to each collection (HistogramInjector)
                meter.create_observable_counter(
                    spec.name, callbacks=[_callback(source, _COUNTER_SOURCES[spec.name],
                                                    spec.name)],
                    unit=spec.unit, description=spec.description,
                )
        source.registry = registry
        if registry is not None:
            source.guard = ExportGuard()
        return source.guard


def _callback(source: _CounterSource,
              observe: Callable[[SpecDecodeTotals], Iterable[Observation]],
              name: str) -> Callable[[CallbackOptions], list[Observation]]:
    def callback(_: CallbackOptions) -> list[Observation]:
        return source.observations(observe, name)

    return callback


def _histogram_point(
    attributes: dict[str, Any],
    bounds: tuple[float, ...],
    counts: list[int],
    total: float,
    minimum: float | None,
    maximum: float | None,
    start_ns: int,
    now_ns: int,
    exemplars: list[Exemplar] | None = None,
) -> HistogramDataPoint:
    return HistogramDataPoint(
        attributes=attributes,
        start_time_unix_nano=start_ns,
        time_unix_nano=now_ns,
        count=sum(counts),
        sum=total,
        bucket_counts=counts,
        explicit_bounds=bounds,
        min=minimum,
        max=maximum,
        exemplars=exemplars or [],
    )


def _length_point(
    entry: SpecDecodeTotals, hist: list[int], start_ns: int, now_ns: int
) -> HistogramDataPoint:
    """Acceptance length = 1 + accepted; ``hist[a]`` counts drafts with ``a``."""
    k = max(entry.num_speculative_tokens, len(hist) - 1)
    bounds = names.acceptance_length_bounds(k)
    # Value 1 + a falls in the bucket whose upper bound is 1 + a: index a.
    counts = list(hist) + [0] * (len(bounds) + 1 - len(hist))
    nonzero = [a for a, c in enumerate(hist) if c]
    total = float(sum((1 + a) * c for a, c in enumerate(hist)))
    low, high = (1.0 + nonzero[0], 1.0 + nonzero[-1]) if nonzero else (None, None)
    return _histogram_point(entry.attributes, bounds, counts, total, low, high, start_ns, now_ns)


class _ReaderState:
    """What one reader saw at its previous collection (for delta temporality)."""

    __slots__ = ("temporality", "last_ns", "last")

    def __init__(self, temporality: AggregationTemporality, start_ns: int) -> None:
        self.temporality = temporality
        self.last_ns = start_ns
        self.last: dict[int, TotalsSnapshot] = {}


class HistogramInjector:
    """Rewrites every collection of the attached readers before export.

    It adds the two histograms to the plugin's scope, and, where the
    resource lacks a per-process identity (a provider the plugin did not
    build), moves the plugin's scope under a copy of the resource with
    ``service.instance.id`` and the data-parallel rank added, so that
    several engine processes never write the same series.
    """

    def __init__(self, registry: TotalsRegistry, resource: Resource, guard: ExportGuard,
                 identity: dict[str, Any], owns_provider: bool) -> None:
        self._registry = registry
        self._resource = resource
        self._guard = guard
        self._identity = identity
        self._owns_provider = owns_provider
        self._scope = InstrumentationScope(names.METER_NAME, __version__)
        self._readers: dict[int, MetricReader] = {}

    def attach(self, reader: MetricReader) -> None:
        if id(reader) in self._readers:
            return
        # The reader's own method, beneath a hook of an earlier runtime
        # (which this one replaces rather than chains).
        original = _sdk_compat.receive_metrics_of(reader)
        if original is None:
            return
        temporality = _sdk_compat.histogram_temporality(reader)
        state = _ReaderState(temporality, time.time_ns())
        self._registry.add_rate_tracker(id(state))
        pid = os.getpid()
        drop_in_child = self._owns_provider

        def receive_metrics(
            metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
        ) -> None:
            if os.getpid() != pid:
                # A forked child's copy of this reader: the SDK restarts its
                # thread after fork. The plugin's own provider holds only the
                # parent's data, sent over the parent's connection: drop it.
                if drop_in_child:
                    return None
            else:
                metrics_data = self._rewrite_safely(metrics_data, state)
            return original(metrics_data, timeout_millis=timeout_millis, **kwargs)

        _sdk_compat.hook_receive_metrics(reader, receive_metrics, original)
        self._readers[id(reader)] = reader

    def detach_all(self) -> None:
        for reader in self._readers.values():
            _sdk_compat.unhook_receive_metrics(reader)
        self._readers.clear()

    def _rewrite_safely(self, metrics_data: MetricsData, state: _ReaderState) -> MetricsData:
        if self._guard.failed:
            return metrics_data
        try:
            return self._rewrite(metrics_data, state)
        except Exception:
            self._guard.trip("building the histograms of a collection")
            return metrics_data

    def _metrics(self, state: _ReaderState) -> list[Metric]:
        now_ns = time.time_ns()
        delta = state.temporality == AggregationTemporality.DELTA
        lengths: list[HistogramDataPoint] = []
        rates: list[HistogramDataPoint] = []
        for entry in self._registry.entries():
            tracker = entry.rate_trackers[id(state)]
            snap = entry.snapshot()
            start_ns = entry.start_time_ns
            length_hist, rate_buckets, rate_sum = (
                snap.accepted_hist, snap.rate_buckets, snap.rate_sum
            )
            if delta:
                prev = state.last.get(id(entry))
                start_ns = max(state.last_ns, entry.start_time_ns)
                if prev is not None:
                    length_hist = _minus(length_hist, prev.accepted_hist)
                    rate_buckets = _minus(rate_buckets, prev.rate_buckets)
                    rate_sum -= prev.rate_sum
                state.last[id(entry)] = snap
            # A cumulative series exists from the engine's start, at zero,
            # like the counters: Prometheus' rate() then sees the first
            # increase. Delta points are sent only for intervals with data.
            if any(length_hist) or not delta:
                lengths.append(_length_point(entry, length_hist, start_ns, now_ns))
            if any(rate_buckets) or not delta:
                minimum, maximum = self._rate_min_max(tracker, delta)
                rates.append(_histogram_point(
                    entry.attributes, names.REQUEST_RATE_BOUNDS, list(rate_buckets),
                    rate_sum, minimum, maximum, start_ns, now_ns,
                    _exemplars(entry, state.last_ns if delta else 0),
                ))
        state.last_ns = now_ns
        out = []
        for name, points in ((names.ACCEPTANCE_LENGTH, lengths),
                             (names.REQUEST_ACCEPTANCE_RATE, rates)):
            if points:
                spec = names.METRIC_BY_NAME[name]
                out.append(
                    Metric(
                        name=name,
                        description=spec.description,
                        unit=spec.unit,
                        data=HistogramData(
                            data_points=points, aggregation_temporality=state.temporality
                        ),
                    )
                )
        return out

    @staticmethod
    def _rate_min_max(tracker: list[float], delta: bool) -> tuple[float | None, float | None]:
        """Min/max since the reader's last collection (delta) or ever (cumulative)."""
        minimum, maximum = tracker
        if delta:
            tracker[0], tracker[1] = float("inf"), float("-inf")
        if minimum > maximum:  # no request finished in this interval
            return None, None
        return minimum, maximum

    def _rewrite(self, metrics_data: MetricsData, state: _ReaderState) -> MetricsData:
        extra = self._metrics(state)
        resource_metrics = list(metrics_data.resource_metrics) if metrics_data else []
        # Take the plugin's scope out of wherever the SDK put it.
        ours: list[Metric] = list(extra)
        home: Resource | None = None
        kept: list[ResourceMetrics] = []
        for rm in resource_metrics:
            scopes = [sm for sm in rm.scope_metrics if sm.scope.name != names.METER_NAME]
            if len(scopes) == len(rm.scope_metrics):
                kept.append(rm)
                continue
            home = home or rm.resource
            ours[:0] = [m for sm in rm.scope_metrics if sm.scope.name == names.METER_NAME
                        for m in sm.metrics]
            if scopes:
                kept.append(ResourceMetrics(rm.resource, scopes, rm.schema_url))
        if not ours:
            return metrics_data
        if home is None:
            home = resource_metrics[0].resource if resource_metrics else self._resource
        missing = {k: v for k, v in self._identity.items() if k not in home.attributes}
        resource = home.merge(Resource(missing)) if missing else home
        scope = ScopeMetrics(self._scope, ours, "")
        for i, rm in enumerate(kept):
            if rm.resource is resource:
                kept[i] = ResourceMetrics(rm.resource, [*rm.scope_metrics, scope], rm.schema_url)
                break
        else:
            kept.append(ResourceMetrics(resource, [scope], ""))
        return MetricsData(resource_metrics=kept)


def _exemplars(entry: SpecDecodeTotals, since_ns: int) -> list[Exemplar]:
    """The request spans linked to the rate buckets (one per bucket, newest)."""
    return [
        Exemplar({}, rate, time_ns, span_id, trace_id)
        for rate, time_ns, trace_id, span_id in filter(None, list(entry.rate_exemplars))
        if time_ns > since_ns
    ]


def _minus(current: Iterable[int], previous: list[int]) -> list[int]:
    current = list(current)
    return [c - (previous[i] if i < len(previous) else 0) for i, c in enumerate(current)]
