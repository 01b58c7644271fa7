"""Grafana dashboard for otel-specdec, generated with grafana-foundation-sdk.

``python -m dashboards.specdec_dashboard`` writes ``dashboards/otel-specdec.json``;
see ``docs/dashboard.md``.
"""
