"""Every use of a private OpenTelemetry attribute, in one place.

The plugin needs a few things the OpenTelemetry Python SDK, its Prometheus
exporter and ``opentelemetry-instrumentation`` do not offer publicly. Each
is reached only through a function here, which checks for it and, where it
is missing (a release that renamed or removed it), degrades: the plugin
loses that one feature, logs why once, and never raises into vLLM. Nothing
else in ``otel_specdec`` names a private OpenTelemetry attribute.

Versions below are the OpenTelemetry Python release trains (SDK ``1.N``,
contrib ``0.(N+21)bX``); the declared minimum (``pyproject.toml``) is
tested by ``tests/test_otel_sdk_range.py`` with ``tests/requirements/``.

``MetricReader._receive_metrics`` (SDK, every 1.x release)
    The method ``MetricReader.collect`` hands each collection to. The
    histograms are added to every collection by shadowing it with an
    instance attribute (``hook_receive_metrics``), because pre-aggregated
    bucket counts cannot be recorded through the API. Missing: the reader
    exports the counters only (no histograms), with one warning.

``MetricReader._instrument_class_temporality`` (SDK, every 1.x release)
    The reader's resolved temporality per instrument class, keyed by the
    SDK's private instrument classes (``_Histogram`` and so on, subclasses
    of the public ones). Read to give the injected histograms the reader's
    histogram temporality. Missing: cumulative, the SDK's default.

``MeterProvider._metric_readers`` (SDK >= 1.43),
``MeterProvider._sdk_config.metric_readers`` (SDK <= 1.42)
    The readers of a provider the plugin did not build, to hook each one.
    Missing: no reader is hooked; ``_runtime`` warns that the histograms
    are not exported (the counters are, through the public API).

``MeterProvider._sdk_config.resource`` (SDK, every 1.x release)
    The provider's resource, so the histograms (built outside the SDK's
    pipeline) carry the same one. Missing: the empty resource, to which
    the plugin adds its per-process identity.

``BaseInstrumentor._check_dependency_conflicts`` (instrumentation, every release)
    The hook ``instrument()`` calls to check the instrumented package.
    Overridden (``AnyOfDependencies``) because vLLM ships under two names
    and either satisfies the plugin; ``get_dependency_conflicts`` takes the
    either-or list (``deps_any``) only from 0.57b0 (train 1.36), so for
    older releases the check is done here, one alternative at a time.

``PrometheusMetricReader(registry=...)`` (exporter-prometheus >= 0.63b0),
``PrometheusMetricReader._collector`` (earlier releases)
    The plugin's /metrics serves its own ``CollectorRegistry``, never
    prometheus_client's global one (which holds vLLM's metrics). Releases
    before 0.63b0 always register with the global registry; the reader's
    private ``_collector`` is then moved to the plugin's registry (and
    unregistered from it at shutdown, which those releases would try on
    the global one). Missing: the reader cannot be built; the error is
    raised to ``_runtime``, which turns metrics off with one error line
    and lets the engine run.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Collection
from typing import Any

from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricReader
from opentelemetry.sdk.resources import Resource

__all__ = [
    "AnyOfDependencies", "dependency_conflicts", "histogram_temporality",
    "hook_receive_metrics", "init_prometheus_reader", "metric_readers", "provider_resource",
    "receive_metrics_of", "shutdown_prometheus_reader", "unhook_receive_metrics",
]

_logger = logging.getLogger(__name__)

# Set on a hook installed by ``hook_receive_metrics``: the reader's own
# method beneath it, so a later hook replaces it rather than chaining.
_ORIGINAL_ATTR = "_otel_specdec_original"

_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        _logger.warning(message, *args)


# --- MeterProvider -------------------------------------------------------


def metric_readers(provider: Any) -> list[MetricReader]:
    """The readers of an SDK ``MeterProvider``; [] where they cannot be found."""
    readers = getattr(provider, "_metric_readers", None)  # SDK >= 1.43
    if readers is None:  # SDK <= 1.42
        readers = getattr(getattr(provider, "_sdk_config", None), "metric_readers", None)
    try:
        return [r for r in readers or () if isinstance(r, MetricReader)]
    except TypeError:  # not iterable: an SDK that means something else by the name
        return []


def provider_resource(provider: Any) -> Resource:
    """The resource of an SDK ``MeterProvider``; the empty one if not found."""
    resource = getattr(getattr(provider, "_sdk_config", None), "resource", None)
    return resource if isinstance(resource, Resource) else Resource.get_empty()


# --- MetricReader --------------------------------------------------------


def histogram_temporality(reader: Any) -> AggregationTemporality:
    """The temporality ``reader`` uses for histograms (cumulative if unknown).

    The SDK keys its table by its private instrument classes (subclasses of
    the public ``Histogram``), whatever class the preference named.
    """
    table = getattr(reader, "_instrument_class_temporality", None)
    if not isinstance(table, dict):
        return AggregationTemporality.CUMULATIVE
    for cls, temporality in table.items():
        if isinstance(cls, type) and issubclass(cls, SdkHistogram):
            return temporality
    return AggregationTemporality.CUMULATIVE


ReceiveMetrics = Callable[..., Any]


def receive_metrics_of(reader: Any) -> ReceiveMetrics | None:
    """The reader's own ``_receive_metrics`` (beneath a hook of ours, if one
    is installed); None where the reader has none (then nothing can be hooked)."""
    original = getattr(reader, "_receive_metrics", None)
    if not callable(original):
        _warn_once(
            "receive_metrics",
            "otel_specdec: the metric reader %s has no _receive_metrics (an OpenTelemetry "
            "SDK this plugin does not know); the histograms are not exported through it",
            type(reader).__name__,
        )
        return None
    return getattr(original, _ORIGINAL_ATTR, original)


def hook_receive_metrics(reader: Any, hook: ReceiveMetrics, original: ReceiveMetrics) -> None:
    """Make ``reader.collect`` hand its collections to ``hook`` (which calls
    ``original``, from ``receive_metrics_of``)."""
    setattr(hook, _ORIGINAL_ATTR, original)
    reader._receive_metrics = hook


def unhook_receive_metrics(reader: Any) -> None:
    """Remove the hook: the class's ``_receive_metrics`` shows through again."""
    try:
        reader.__dict__.pop("_receive_metrics", None)
    except AttributeError:  # no instance dictionary: never hooked
        pass


# --- opentelemetry-instrumentation --------------------------------------


def _takes_deps_any() -> bool:
    from opentelemetry.instrumentation.dependencies import get_dependency_conflicts

    try:
        return len(inspect.signature(get_dependency_conflicts).parameters) >= 2
    except (TypeError, ValueError):
        return False


def dependency_conflicts(required: Collection[str], any_of: Collection[str]) -> Any:
    """A conflict if one of ``required`` or all of ``any_of`` are unmet, else None
    (``opentelemetry.instrumentation.dependencies.DependencyConflict``)."""
    from opentelemetry.instrumentation.dependencies import (
        DependencyConflict,
        get_dependency_conflicts,
    )

    if _takes_deps_any():  # instrumentation >= 0.57b0
        return get_dependency_conflicts(required, any_of)
    conflict = get_dependency_conflicts(required)
    if conflict is not None or not any_of:
        return conflict
    unmet = []
    for dep in any_of:
        conflict = get_dependency_conflicts([dep])
        if conflict is None:
            return None
        unmet.append(conflict)
    return DependencyConflict(
        " or ".join(str(c.required) for c in unmet),
        ", ".join(str(c.found) for c in unmet if c.found) or None,
    )


class AnyOfDependencies:
    """Mixin for a ``BaseInstrumentor`` whose host package has several names.

    ``instruments_any`` lists the alternatives (the ``instruments-any``
    extra); ``instrumentation_dependencies()`` the packages all required.
    """

    instruments_any: Collection[str] = ()

    def _check_dependency_conflicts(self) -> Any:
        return dependency_conflicts(
            self.instrumentation_dependencies(),  # type: ignore[attr-defined]
            self.instruments_any,
        )


# --- opentelemetry-exporter-prometheus ----------------------------------


def _prometheus_takes_registry(reader_cls: type) -> bool:
    try:
        return "registry" in inspect.signature(reader_cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def init_prometheus_reader(reader: Any, registry: Any) -> None:
    """Run ``PrometheusMetricReader.__init__`` on ``reader`` so that it
    registers with ``registry`` (a ``CollectorRegistry``) only."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY

    if _prometheus_takes_registry(PrometheusMetricReader):  # exporter >= 0.63b0
        PrometheusMetricReader.__init__(reader, registry=registry)
        return
    PrometheusMetricReader.__init__(reader)  # registers with the global registry
    collector = getattr(reader, "_collector", None)
    if collector is None:
        raise RuntimeError(
            "this opentelemetry-exporter-prometheus cannot serve a registry of its own "
            "(no registry= argument, no _collector); upgrade it"
        )
    REGISTRY.unregister(collector)
    registry.register(collector)


def shutdown_prometheus_reader(reader: Any, registry: Any, timeout_millis: float,
                               **kwargs: Any) -> None:
    """``PrometheusMetricReader.shutdown`` for a reader set up by ``init_prometheus_reader``."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    if _prometheus_takes_registry(PrometheusMetricReader):
        PrometheusMetricReader.shutdown(reader, timeout_millis=timeout_millis, **kwargs)
        return
    # Those releases' shutdown only unregisters the collector, from the
    # global registry, where it no longer is.
    try:
        registry.unregister(getattr(reader, "_collector", None))
    except KeyError:  # already shut down
        pass
