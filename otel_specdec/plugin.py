"""vLLM general-plugin entry point (``vllm.general_plugins``).

vLLM calls ``register`` in every process it starts (API server, engine
core, workers), possibly more than once. It is idempotent, imports the
instrumentation lazily and never raises; only the engine-core process,
where the scheduler runs, ever builds an exporter.
"""

from __future__ import annotations

import logging

from otel_specdec import environment_variables as env_vars

__all__ = ["register"]

_logger = logging.getLogger(__name__)

# Set to "0"/"false" to keep the plugin installed but inactive.
ENABLE_ENV = env_vars.OTEL_SPECDEC_ENABLED


def _enabled() -> bool:
    from otel_specdec._settings import env_flag

    return env_flag(ENABLE_ENV, True, "the plugin stays enabled")


def register() -> None:
    try:
        if not _enabled():
            return
        from otel_specdec.instrumentor import SpecDecodeInstrumentor

        instrumentor = SpecDecodeInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            # vLLM itself is loading us, so it is present (whatever its
            # distribution is named); the patch checks its structure.
            instrumentor.instrument(skip_dep_check=True)
    except Exception:
        _logger.exception("otel_specdec: failed to activate; vLLM continues without it")
