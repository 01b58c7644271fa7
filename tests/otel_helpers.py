"""Read exported metrics back as plain numbers."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics.export import HistogramDataPoint, MetricsData

POSITION = "vllm.spec_decode.position"


def points(data: MetricsData | None, name: str) -> list[Any]:
    out = []
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    out.extend(metric.data.data_points)
    return out


def total(data: MetricsData | None, name: str) -> int:
    return sum(p.value for p in points(data, name))


def per_position(data: MetricsData | None, name: str) -> list[int]:
    by_pos: dict[int, int] = {}
    for p in points(data, name):
        by_pos[p.attributes[POSITION]] = by_pos.get(p.attributes[POSITION], 0) + p.value
    return [by_pos[i] for i in sorted(by_pos)]


def histogram(data: MetricsData | None, name: str) -> HistogramDataPoint | None:
    found = points(data, name)
    assert len(found) <= 1, f"expected one {name} series, got {len(found)}"
    return found[0] if found else None
