from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from vllm_releases import prepare_release_host  # noqa: E402

# In a child run against another vLLM release (tests/vllm_releases.py).
prepare_release_host()

# The unit tests' processes never export to a default endpoint by accident.
os.environ.setdefault("OTEL_METRICS_EXPORTER", "none")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from otel_specdec.demo.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("target"), seed=0))


@pytest.fixture(scope="session")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Same architecture and tokenizer, other weights: a draft that disagrees."""
    from otel_specdec.demo.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("draft"), seed=1))


@pytest.fixture
def reader() -> Iterator[object]:
    """The plugin instrumented onto a fresh SDK provider with an in-memory reader."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_specdec import SpecDecodeInstrumentor

    instrumentor = SpecDecodeInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    memory_reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[memory_reader], shutdown_on_exit=False)
    instrumentor.instrument(meter_provider=provider)
    yield memory_reader
    instrumentor.uninstrument()
    provider.shutdown()


@pytest.fixture
def env_provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The plugin instrumented with no provider and no OTEL_* settings: it
    builds its own from the environment (as in an engine process) when a
    scheduler is created. Set variables on the returned monkeypatch."""
    from otel_specdec import SpecDecodeInstrumentor

    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    instrumentor = SpecDecodeInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    instrumentor.instrument()
    yield monkeypatch
    instrumentor.uninstrument()
