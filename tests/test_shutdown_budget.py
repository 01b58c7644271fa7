"""The plugin's shutdown budget and the OTLP timeout's unit, where they are
decided: vLLM's real scheduler (driven by the harness), the plugin's own
provider and exporters, and a collector on loopback that hangs.

The engine-level counterparts (every shutdown path, every fault) are in
``test_collector_faults.py``.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from faulty_collectors import FaultyCollector
from test_failures import K, plugin_records, run_steps

from otel_specdec import _runtime, _settings
from otel_specdec._settings import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    MAX_SHUTDOWN_TIMEOUT_S,
    SHUTDOWN_TIMEOUT_ENV,
)

TIMEOUT_VARIABLES = [("OTEL_EXPORTER_OTLP_TIMEOUT", "METRICS"),
                     ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "METRICS"),
                     ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "TRACES")]


@pytest.fixture(autouse=True)
def _fresh_unit_warnings(monkeypatch):
    monkeypatch.setattr(_settings, "_unit_warned", set())


@pytest.mark.parametrize(("variable", "signal"), TIMEOUT_VARIABLES)
def test_a_timeout_in_milliseconds_is_read_as_such_with_one_warning(
        monkeypatch, caplog, variable, signal):
    monkeypatch.setenv(variable, "10000")
    with caplog.at_level(logging.WARNING):
        first = _settings.otlp_timeout_s(signal)
        again = _settings.otlp_timeout_s(signal)
    assert first == again == 10000 / 1000
    [record] = plugin_records(caplog)
    message = record.getMessage()
    assert f"{variable}=10000" in message
    # Both readings, and what the plugin does.
    assert "10 s" in message and "10000 s" in message and "milliseconds" in message


def test_a_timeout_below_a_thousand_keeps_the_sdk_reading(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "999")
    with caplog.at_level(logging.WARNING):
        assert _settings.otlp_timeout_s() == 999
    assert not plugin_records(caplog)


@pytest.mark.parametrize(("value", "expected", "logged"), [
    (None, DEFAULT_SHUTDOWN_TIMEOUT_S, False),
    ("2.5", 2.5, False),
    ("soon", DEFAULT_SHUTDOWN_TIMEOUT_S, True),
    ("-1", DEFAULT_SHUTDOWN_TIMEOUT_S, True),
    ("100000", MAX_SHUTDOWN_TIMEOUT_S, True),
])
def test_shutdown_budget_setting(monkeypatch, caplog, value, expected, logged):
    if value is not None:
        monkeypatch.setenv(SHUTDOWN_TIMEOUT_ENV, value)
    with caplog.at_level(logging.WARNING):
        assert _settings.shutdown_budget_s() == expected
    records = plugin_records(caplog)
    assert len(records) == int(logged)
    if logged:
        assert SHUTDOWN_TIMEOUT_ENV in records[0].getMessage()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_plugins_exporter_uses_the_millisecond_reading(tiny_model, env_provider, protocol):
    """1500 meant as milliseconds: the plugin's exporter gives up on a
    hanging collector after 1.5 s, not 1500 s."""
    with FaultyCollector("hang", protocol) as hung:
        env_provider.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", hung.endpoint)
        env_provider.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        env_provider.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1500")
        run_steps(tiny_model)
        runtime = _runtime.current()
        assert runtime is not None
        # Not through the plugin's bounded shutdown: the exporter alone.
        flush = threading.Thread(
            target=runtime.provider.force_flush, kwargs={"timeout_millis": 600_000}, daemon=True)
        start = time.monotonic()
        flush.start()
        flush.join(timeout=30)
        elapsed = time.monotonic() - start
        assert hung.contacts > 0
    assert not flush.is_alive() and elapsed < 1.5 + 3, elapsed


@pytest.mark.parametrize(("protocol", "spans"), [("grpc", False), ("http/protobuf", False),
                                                 ("grpc", True)])
def test_shutdown_ends_within_the_budget_whatever_the_timeouts(
        tiny_model, env_provider, caplog, protocol, spans):
    """Exports hang, each may take 10000 (s, or ms): the plugin's shutdown,
    metrics then spans, takes the budget and says what was not delivered."""
    budget = 1.5
    with FaultyCollector("hang", protocol) as hung, caplog.at_level(logging.WARNING):
        for name, value in {
            "OTEL_EXPORTER_OTLP_ENDPOINT": hung.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_TIMEOUT": "10000", "OTEL_METRIC_EXPORT_INTERVAL": "100",
            SHUTDOWN_TIMEOUT_ENV: str(budget), "OTEL_SPECDEC_TRACES": str(spans).lower(),
        }.items():
            env_provider.setenv(name, value)
        harness = run_steps(tiny_model, steps=12)
        assert harness.vllm.drafts > 0
        time.sleep(0.5)  # a periodic export is now stuck on the collector
        start = time.monotonic()
        _runtime.shutdown()
        elapsed = time.monotonic() - start
        assert hung.contacts > 0
    assert elapsed < budget + 1.0, elapsed
    cut = [r.getMessage() for r in plugin_records(caplog) if "not delivered" in r.getMessage()]
    # The plugin's series: drafts, empty proposals, padding, two histograms,
    # and drafted and accepted tokens at each of the k positions (see
    # "Cardinality" in docs/operations.md).
    assert len(cut) == 1 and f"of {5 + 2 * K} data points" in cut[0], cut
    assert f"cut short by the shutdown budget ({SHUTDOWN_TIMEOUT_ENV}={budget:g} s)" in cut[0]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_final_export_the_collector_refuses_is_reported_as_such(
        tiny_model, env_provider, caplog, protocol):
    """503 / UNAVAILABLE with a 1 s export timeout, inside a 5 s budget: the
    export ends by itself, undelivered, and the line says why."""
    with FaultyCollector("unavailable", protocol) as refusing, caplog.at_level(logging.WARNING):
        for name, value in {
            "OTEL_EXPORTER_OTLP_ENDPOINT": refusing.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
            "OTEL_METRIC_EXPORT_INTERVAL": "600000", SHUTDOWN_TIMEOUT_ENV: "5",
        }.items():
            env_provider.setenv(name, value)
        run_steps(tiny_model)
        start = time.monotonic()
        _runtime.shutdown()
        elapsed = time.monotonic() - start
        assert refusing.contacts > 0
    assert elapsed < 1 + 2.5, elapsed
    cut = [r.getMessage() for r in plugin_records(caplog) if "not delivered" in r.getMessage()]
    assert len(cut) == 1 and "was not accepted by the collector" in cut[0], cut
