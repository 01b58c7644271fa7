"""The metric contract (``_instruments.METRICS``) is what the docs say and
what the exporter sends: the README's metric table and the table in
``docs/metrics.md`` list exactly its metrics, with their instrument, unit and
attributes, and the instruments a reader receives carry the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from scheduler_harness import SchedulerHarness, build_scheduler

from otel_specdec import _instruments as names

REPO = Path(__file__).resolve().parent.parent


def table_rows(path: Path, cells: int) -> dict[str, list[str]]:
    """Rows of the metric table in ``path`` (the one whose rows have a name
    and ``cells`` more cells): metric name -> its other cells."""
    rows = {}
    for line in path.read_text().splitlines():
        match = re.match(r"\|\s*`(vllm\.spec_decode\.[\w.]+)`\s*\|(.*)\|\s*$", line)
        if match:
            row = [c.strip() for c in match.group(2).split("|")]
            if len(row) == cells:
                rows.setdefault(match.group(1), row)
    return rows


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_readme_table_is_the_contract():
    rows = table_rows(REPO / "README.md", 3)
    assert set(rows) == set(names.METRIC_BY_NAME)
    for name, (instrument, unit, _meaning) in rows.items():
        spec = names.METRIC_BY_NAME[name]
        assert instrument.split(",")[0] == spec.instrument, name
        assert ticked(instrument) == list(spec.attributes), name
        assert ticked(unit) == [spec.unit], name


def test_metrics_doc_table_is_the_contract():
    rows = table_rows(REPO / "docs" / "metrics.md", 5)
    assert set(rows) == set(names.METRIC_BY_NAME)
    for name, (instrument, unit, attributes, _meaning, _vllm) in rows.items():
        spec = names.METRIC_BY_NAME[name]
        assert instrument == spec.instrument, name
        assert ticked(unit) == [spec.unit], name
        assert ticked(attributes) == list(spec.attributes), name
    text = (REPO / "docs" / "metrics.md").read_text()
    for key in names.COMMON_ATTRIBUTES:
        assert f"| `{key}` |" in text


@pytest.fixture
def harness_reader(tiny_model, reader):
    """A few requests run to their end through vLLM's scheduler, with drafts."""
    harness = SchedulerHarness(build_scheduler(tiny_model, 3))
    harness.add_requests(4, max_tokens=12)
    while harness.scheduler.requests:
        harness.step(lambda r, d: len(d) // 2, lambda r: [21, 22, 23])
    return reader, harness


def test_exported_instruments_are_the_contract(harness_reader):
    reader, _harness = harness_reader
    seen = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                seen[metric.name] = metric
    assert set(seen) == set(names.METRIC_BY_NAME)
    for name, metric in seen.items():
        spec = names.METRIC_BY_NAME[name]
        assert (metric.unit, metric.description) == (spec.unit, spec.description)
        kind = type(metric.data).__name__
        assert kind == ("Sum" if spec.instrument == names.COUNTER else "Histogram"), name
        for point in metric.data.data_points:
            assert set(point.attributes) == set(names.COMMON_ATTRIBUTES) | set(spec.attributes)
