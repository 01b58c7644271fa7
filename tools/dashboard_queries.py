"""Read the dashboard's PromQL and make it sendable to Prometheus's HTTP API.

``panel_queries(dashboard)`` lists (panel title, expr) for every target of every
panel, rows' nested panels included. ``substitute(expr)`` replaces Grafana's
variables the way Grafana would with the dashboard's defaults:

- ``$__rate_interval`` / ``${__rate_interval}`` -> ``"5m"``;
- query, custom and ad hoc variables (``$model``, ``$method``, ``$instance``)
  -> ``".*"``, the dashboard's "All" value, meant for ``=~`` matchers;
- constant and text box variables (``$cost_ratio``) -> their default value.

Any name in ``values`` overrides that, ``__rate_interval`` included; values are
inserted verbatim (escape regex metacharacters yourself). A variable that is
neither known nor given raises ``KeyError``, so nothing reaches Prometheus with
a ``$`` left in it (``$1``-style references, as in ``label_replace``, stay).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

DASHBOARD_PATH = Path(__file__).resolve().parents[1] / "dashboards" / "otel-specdec.json"

RATE_INTERVAL_DEFAULT = "5m"
ALL_REGEX = ".*"

# Grafana's variable syntaxes: ${name}, ${name:format}, [[name]], [[name:format]], $name.
_VARIABLE = re.compile(
    r"\$\{(?P<braced>\w+)(?::[^}]*)?\}"
    r"|\[\[(?P<bracketed>\w+)(?::[^\]]*)?\]\]"
    r"|\$(?P<plain>\w+)"
)

_REGEX_TYPES = frozenset({"query", "custom", "adhoc"})
_VALUE_TYPES = frozenset({"constant", "textbox", "interval"})


def load_dashboard(path: Path | str = DASHBOARD_PATH) -> dict[str, Any]:
    """The committed dashboard JSON (a fresh copy each call)."""
    return json.loads(_read(str(path)))


@lru_cache(maxsize=8)
def _read(path: str) -> str:
    return Path(path).read_text(encoding="utf-8")


def iter_panels(panels: list[dict[str, Any]] | None) -> Iterator[dict[str, Any]]:
    """Every panel in layout order, each row followed by its nested panels."""
    for panel in panels or []:
        yield panel
        yield from iter_panels(panel.get("panels"))


def panel_queries(dashboard: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL expr) for every target with an expr, in layout order."""
    return [
        (panel.get("title", ""), target["expr"])
        for panel in iter_panels(dashboard.get("panels"))
        for target in panel.get("targets") or []
        if isinstance(target, Mapping) and target.get("expr")
    ]


def variable_defaults(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """What each template variable becomes when nothing else is chosen."""
    defaults: dict[str, str] = {}
    for variable in (dashboard.get("templating") or {}).get("list") or []:
        name, kind = variable.get("name"), variable.get("type")
        if not name:
            continue
        if kind in _REGEX_TYPES:
            defaults[name] = ALL_REGEX
        elif kind in _VALUE_TYPES:
            defaults[name] = _default_value(variable)
        # datasource variables select the data source; they never belong in an expr.
    return defaults


def _default_value(variable: Mapping[str, Any]) -> str:
    query = variable.get("query")
    if isinstance(query, str) and query != "":
        return query
    current = variable.get("current") or {}
    value = current.get("value")
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None or value == "":
        raise ValueError(f"variable {variable.get('name')!r} has no default value")
    return str(value)


def substitute(
    expr: str,
    values: Mapping[str, str] | None = None,
    *,
    dashboard: Mapping[str, Any] | None = None,
) -> str:
    """``expr`` with every Grafana variable replaced (see the module docstring).

    ``dashboard`` supplies the variables and their defaults; the committed
    ``dashboards/otel-specdec.json`` when omitted.
    """
    known = variable_defaults(dashboard if dashboard is not None else load_dashboard())
    known["__rate_interval"] = RATE_INTERVAL_DEFAULT
    if values:
        known.update(values)

    def replace(match: re.Match[str]) -> str:
        name = match.group("braced") or match.group("bracketed") or match.group("plain")
        if name[0].isdigit():  # $1 in a label_replace replacement is PromQL's, not Grafana's
            return match.group(0)
        try:
            return known[name]
        except KeyError:
            raise KeyError(
                f"unknown Grafana variable {match.group(0)!r}; pass it in values"
            ) from None

    return _VARIABLE.sub(replace, expr)
