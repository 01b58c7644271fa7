"""Repository tools, not shipped: run from the repository root as modules.

``python -m tools.dashboard_codegen`` writes ``dashboards/otel-specdec.json``
(the Grafana dashboard, generated with grafana-foundation-sdk; see
``docs/dashboard.md``); ``tools.dashboard_queries`` reads a dashboard's
panels and PromQL, for the tests.
"""
