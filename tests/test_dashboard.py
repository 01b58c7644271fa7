"""The Grafana dashboard: generated, committed, and its PromQL correct.

No vLLM engine is started. The numeric checks evaluate every dashboard query
with promtool's PromQL engine (``promtool test rules``) on synthetic counters
and compare with values computed here from the metric definitions in
docs/metrics.md. Without promtool those checks skip, unless CI=true.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tools import dashboard_codegen as gen
from tools.dashboard_queries import iter_panels, load_dashboard, panel_queries, substitute

REPO = Path(__file__).resolve().parent.parent

KNOWN_METRICS = frozenset(
    {
        "vllm_spec_decode_drafts_total",
        "vllm_spec_decode_draft_tokens_total",
        "vllm_spec_decode_accepted_tokens_total",
        "vllm_spec_decode_empty_proposals_total",
        "vllm_spec_decode_padding_tokens_total",
        "vllm_spec_decode_acceptance_length_bucket",
        "vllm_spec_decode_acceptance_length_sum",
        "vllm_spec_decode_acceptance_length_count",
        "vllm_spec_decode_request_acceptance_rate_bucket",
        "vllm_spec_decode_request_acceptance_rate_sum",
        "vllm_spec_decode_request_acceptance_rate_count",
    }
)
LABELS = frozenset(
    {
        "gen_ai_request_model",
        "vllm_spec_decode_method",
        "vllm_spec_decode_num_speculative_tokens",
        "vllm_spec_decode_position",
        "job",
        "instance",
        "le",
    }
)
PROMQL_WORDS = frozenset(
    {"sum", "count", "min", "rate", "histogram_quantile", "by", "on", "group_left", "and", "or"}
)
REQUIRED_MATCHERS = {
    ("gen_ai_request_model", "=~", "$model"),
    ("vllm_spec_decode_method", "=~", "$method"),
    ("instance", "=~", "$instance"),
}
MODEL_METHOD = {"gen_ai_request_model", "vllm_spec_decode_method"}

# Required panels: title -> Grafana panel type.
REQUIRED_PANELS = {
    "Acceptance rate": "timeseries",
    "Mean acceptance length": "timeseries",
    "Per-position acceptance rate": "timeseries",
    "Acceptance length distribution": "heatmap",
    "Per-request acceptance rate (p10 / p50 / p90)": "timeseries",
    "Drafted vs accepted tokens per second": "timeseries",
    "Zero-proposal share": "timeseries",
    "Expected speedup (Leviathan et al.)": "timeseries",
    "System efficiency": "timeseries",
    "Acceptance rate by instance": "timeseries",
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load_dashboard()


def _targets(dashboard: dict) -> list[tuple[dict, dict]]:
    return [
        (panel, target)
        for panel in iter_panels(dashboard["panels"])
        for target in panel.get("targets") or []
    ]


# --- generated, committed, deterministic --------------------------------------


def test_committed_json_is_what_the_generator_writes() -> None:
    committed = gen.OUTPUT.read_text(encoding="utf-8")
    assert gen.render() == committed, (
        "dashboards/otel-specdec.json is stale: run `python -m tools.dashboard_codegen`"
    )


def test_generation_is_deterministic_and_sorted() -> None:
    first, second = gen.render(), gen.render()
    assert first == second
    data = json.loads(first)
    assert json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n" == first
    assert data["uid"] == "otel-specdec"
    # Nothing instance-specific: Grafana assigns id and version on import.
    for key in ("id", "version", "iteration", "created", "updated"):
        assert key not in data
    assert not re.search(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}", first), "timestamp in the JSON"


def test_check_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gen.main(["--check"]) == 0
    out = tmp_path / "dash.json"
    assert gen.main(["--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == gen.render()
    assert gen.main(["--check", "--output", str(out)]) == 0
    edited = out.read_text(encoding="utf-8").replace('"query": "0.05"', '"query": "0.5"')
    assert edited != gen.render()
    out.write_text(edited, encoding="utf-8")
    assert gen.main(["--check", "--output", str(out)]) == 1
    assert gen.main(["--check", "--output", str(tmp_path / "missing.json")]) == 1
    capsys.readouterr()


def test_module_entry_point_check() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.dashboard_codegen", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- structure ----------------------------------------------------------------


def test_required_panels_exist(dashboard: dict) -> None:
    panels = {p.get("title"): p for p in iter_panels(dashboard["panels"])}
    for title, kind in REQUIRED_PANELS.items():
        assert title in panels, f"missing panel {title!r}"
        assert panels[title]["type"] == kind, title
        assert panels[title]["targets"], title


def test_template_variables(dashboard: dict) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name, label in (
        ("model", "gen_ai_request_model"),
        ("method", "vllm_spec_decode_method"),
        ("instance", "instance"),
    ):
        var = variables[name]
        assert var["type"] == "query"
        assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert re.fullmatch(
            rf"label_values\(vllm_spec_decode_drafts_total(\{{[^}}]*\}})?, {label}\)",
            var["query"],
        ), var["query"]
        assert var["multi"] is True
        assert var["includeAll"] is True
        assert var["allValue"] == ".*"
        assert var["current"]["value"] == "$__all"
    cost = variables["cost_ratio"]
    assert cost["type"] in ("textbox", "constant")
    assert cost["query"] == "0.05"
    assert float(cost["query"]) == 0.05


def test_panels_use_the_datasource_variable_and_have_descriptions(dashboard: dict) -> None:
    ref = {"type": "prometheus", "uid": "${datasource}"}
    for panel in iter_panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        title = panel["title"]
        assert panel["datasource"] == ref, title
        assert 20 <= len(panel.get("description", "")) <= 400, title
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in panel["targets"]:
            assert target["datasource"] == ref, title
            assert target["legendFormat"], title
    heatmap = next(p for p in iter_panels(dashboard["panels"]) if p["type"] == "heatmap")
    assert heatmap["targets"][0]["format"] == "heatmap"
    assert heatmap["targets"][0]["legendFormat"] == "{{le}}"
    assert heatmap["options"]["calculate"] is False


def test_layout_ids_and_grid(dashboard: dict) -> None:
    panels = list(iter_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert ids == list(range(1, len(panels) + 1))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["x"] + pos["w"] <= 24
        area = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not area & cells, f"{panel.get('title')} overlaps another panel"
        cells |= area
    for row in (p for p in dashboard["panels"] if p["type"] == "row"):
        assert row["collapsed"] == bool(row.get("panels")), row["title"]


# --- PromQL: static checks ----------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    |(?P<string>"(?:[^"\\]|\\.)*")
    |(?P<range>\[[^\]]*\])
    |(?P<variable>\$\{\w+\}|\$\w+)
    |(?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
    |(?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<op>>=|<=|==|!=|=~|!~|[-+*/^<>=(){},])
    """,
    re.VERBOSE,
)
_SELECTOR = re.compile(r"(?P<metric>[A-Za-z_:][A-Za-z0-9_:]*)\{(?P<body>[^}]*)\}")
_MATCHER = re.compile(r'\s*(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_GROUPING = re.compile(r"\b(?:sum|count|min)\s+by\s*\(([^)]*)\)|\bon\s*\(([^)]*)\)")


def _tokens(expr: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        assert match, f"unexpected character {expr[pos]!r} at {pos} in:\n{expr}"
        if match.lastgroup != "space":
            tokens.append((match.lastgroup, match.group()))
        pos = match.end()
    return tokens


def _check_balanced(expr: str) -> None:
    pairs = {")": "(", "}": "{", "]": "["}
    stack = []
    for kind, text in _tokens(expr):
        if kind == "range":
            continue
        if text in "({[":
            stack.append(text)
        elif text in pairs:
            assert stack and stack[-1] == pairs[text], f"unbalanced {text!r} in:\n{expr}"
            stack.pop()
    assert not stack, f"unclosed {stack} in:\n{expr}"


def _check_promql(title: str, expr: str) -> None:
    _check_balanced(expr)
    tokens = _tokens(expr)
    for kind, text in tokens:
        if kind == "ident":
            assert text in KNOWN_METRICS | LABELS | PROMQL_WORDS, f"{title}: unknown name {text!r}"
        elif kind == "range":
            assert text == "[$__rate_interval]", f"{title}: window {text}"
        elif kind == "variable":
            assert text in ("$model", "$method", "$instance", "$cost_ratio"), (
                f"{title}: variable {text}"
            )
    for i, (_, text) in enumerate(tokens):
        if text in ("sum", "count", "min"):
            assert tokens[i + 1][1] == "by", f"{title}: {text} without by (...)"
        if text in ("group_left", "group_right"):
            # Without an explicit label list, a parenthesised right-hand side
            # would be parsed as the label list.
            close = next(j for j in range(i + 1, len(tokens)) if tokens[j][1] == ")")
            assert tokens[i + 1][1] == "(", f"{title}: {text} needs a label list"
            assert all(kind in ("ident", "op") and t != "(" for kind, t in tokens[i + 2 : close])
    metrics = [text for kind, text in tokens if kind == "ident" and text in KNOWN_METRICS]
    selectors = list(_SELECTOR.finditer(expr))
    assert metrics, f"{title}: no metric"
    assert [m.group("metric") for m in selectors] == metrics, (
        f"{title}: every metric needs a selector"
    )
    for selector in selectors:
        body = selector.group("body")
        matchers = set(_MATCHER.findall(body))
        assert matchers == REQUIRED_MATCHERS, f"{title}: selector {selector.group()}"
    # Ranges only inside rate(); rate() only over counters and buckets.
    assert expr.count("[$__rate_interval]") == expr.count("rate(")
    for match in re.finditer(r"rate\((\w+)\{", expr):
        assert match.group(1).endswith(("_total", "_bucket")), match.group()
    # Aggregations: by model and method (instances summed), or by le for the heatmap;
    # the instance label only in the per-instance panel.
    for match in _GROUPING.finditer(expr):
        labels = {s.strip() for s in (match.group(1) or match.group(2)).split(",")}
        assert labels <= LABELS - {"job", "vllm_spec_decode_num_speculative_tokens"}
        if labels == {"le"}:
            assert "heatmap" in title.lower() or "distribution" in title.lower()
            continue
        assert MODEL_METHOD <= labels, f"{title}: grouping {match.group()}"
        assert ("instance" in labels) == ("instance" in title.lower()), match.group()


def test_every_expression_is_plausible_promql(dashboard: dict) -> None:
    queries = panel_queries(dashboard)
    assert len(queries) >= len(REQUIRED_PANELS)
    for title, expr in queries:
        _check_promql(title, expr)


def test_static_checker_rejects_broken_queries() -> None:
    good = gen.ACCEPTANCE_RATE
    _check_promql("Acceptance rate", good)
    _check_promql("Per-position acceptance rate", gen.PER_POSITION_ACCEPTANCE)
    _check_promql("Expected speedup (Leviathan et al.)", gen.PER_TOKEN_ACCEPTANCE)
    broken = [
        good[:-1],  # unbalanced
        good.replace("vllm_spec_decode_draft_tokens_total", "vllm_spec_decode_draft_token_total"),
        good.replace(', instance=~"$instance"', "", 1),
        good.replace("[$__rate_interval]", "[5m]", 1),
        good.replace("rate(", "irate(", 1),
        good.replace("sum by (gen_ai_request_model, vllm_spec_decode_method)", "sum", 1),
        gen.PER_POSITION_ACCEPTANCE.replace("group_left ()", "group_left"),
        gen.PER_TOKEN_ACCEPTANCE.replace(
            "min by (gen_ai_request_model, vllm_spec_decode_method)", "min"
        ),
        "vllm:spec_decode_num_drafts_total",
    ]
    for expr in broken:
        with pytest.raises(AssertionError):
            _check_promql("Acceptance rate", expr)


def test_ratio_panels_are_ratios_of_rates_over_the_same_window(dashboard: dict) -> None:
    exprs = dict(panel_queries(dashboard))
    ratio = re.compile(r"/\s*(on \([^)]*\) group_left\s*)?\(")
    for title in (
        "Acceptance rate",
        "Mean acceptance length",
        "Per-position acceptance rate",
        "Zero-proposal share",
        "System efficiency",
        "Acceptance rate by instance",
    ):
        expr = exprs[title]
        assert ratio.search(expr), title
        assert "> 0" in expr, f"{title}: a 0 denominator should drop the series"
    assert "$cost_ratio" in exprs["Expected speedup (Leviathan et al.)"]


# --- the helper ---------------------------------------------------------------


def test_panel_queries_walks_rows_and_nested_panels() -> None:
    dash = {
        "panels": [
            {
                "type": "row",
                "title": "r",
                "panels": [
                    {"title": "nested", "targets": [{"expr": "a"}, {"expr": "b"}]},
                ],
            },
            {"title": "top", "targets": [{"expr": "c"}, {"refId": "X"}]},
            {"title": "text"},
        ]
    }
    assert panel_queries(dash) == [("nested", "a"), ("nested", "b"), ("top", "c")]


def test_panel_queries_on_the_dashboard(dashboard: dict) -> None:
    queries = panel_queries(dashboard)
    assert len(queries) == len(_targets(dashboard))
    titles = {title for title, _ in queries}
    assert "Acceptance rate by instance" in titles  # inside the collapsed row
    for _, expr in queries:
        assert "$" not in substitute(expr)


def test_substitute() -> None:
    expr = (
        'rate(x{gen_ai_request_model=~"$model", vllm_spec_decode_method=~"${method}", '
        'instance=~"[[instance]]"}[$__rate_interval]) * $cost_ratio + ${__rate_interval:raw}'
    )
    assert substitute(expr) == (
        'rate(x{gen_ai_request_model=~".*", vllm_spec_decode_method=~".*", '
        'instance=~".*"}[5m]) * 0.05 + 5m'
    )
    assert substitute(expr, {"model": "m1|m2", "__rate_interval": "1m", "cost_ratio": "0.2"}) == (
        'rate(x{gen_ai_request_model=~"m1|m2", vllm_spec_decode_method=~".*", '
        'instance=~".*"}[1m]) * 0.2 + 1m'
    )
    assert substitute('label_replace(x, "a", "$1", "b", "(.*)")') == (
        'label_replace(x, "a", "$1", "b", "(.*)")'
    )
    with pytest.raises(KeyError, match="nope"):
        substitute("x[$nope]")
    custom = {
        "templating": {
            "list": [
                {"name": "ds", "type": "datasource", "query": "prometheus"},
                {"name": "c", "type": "constant", "query": "7"},
                {"name": "t", "type": "textbox", "query": "", "current": {"value": "3"}},
                {"name": "q", "type": "custom", "query": "a,b"},
            ]
        }
    }
    assert substitute("$c $t $q", dashboard=custom) == "7 3 .*"
    with pytest.raises(KeyError):
        substitute("$ds", dashboard=custom)


# --- PromQL: promtool -----------------------------------------------------------


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is required under CI=true (apt-get install prometheus)")
        pytest.skip("promtool not installed")
    return path


def _run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_promtool_parses_every_expression(dashboard: dict, tmp_path: Path) -> None:
    queries = panel_queries(dashboard)
    rules = {
        "groups": [
            {
                "name": "otel_specdec_dashboard",
                "rules": [
                    {"record": f"otel_specdec_dashboard:query{i}", "expr": substitute(expr)}
                    for i, (_, expr) in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"  # JSON is valid YAML
    path.write_text(json.dumps(rules, indent=2))
    proc = _run_promtool("check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(queries)} rules found" in proc.stdout + proc.stderr


# Synthetic engines. Counter increments are per minute; the series are
# linear, so rate over 5m at t=10m is increment / 60 per second.


@dataclass(frozen=True)
class Engine:
    model: str
    method: str
    instance: str
    drafts: int
    empty: int
    padding: int
    drafted: tuple[int, ...]  # per position
    accepted: tuple[int, ...]  # per position: drafts with more than p tokens accepted
    request_rates: tuple[float, ...] = field(default=())  # finished requests per minute

    @property
    def k(self) -> int:
        return len(self.drafted)

    @property
    def labels(self) -> dict[str, str]:
        return {
            "gen_ai_request_model": self.model,
            "vllm_spec_decode_method": self.method,
            "vllm_spec_decode_num_speculative_tokens": str(self.k),
            "job": "vllm",
            "instance": self.instance,
        }

    def length_counts(self) -> dict[int, int]:
        """Drafts per minute by acceptance length (1 + accepted)."""
        at_least = (self.drafts, *self.accepted, 0)
        return {j + 1: at_least[j] - at_least[j + 1] for j in range(self.k + 1)}


ENGINES = (
    Engine("m1", "ngram", "i1", 10, 5, 1, (10, 8, 6), (7, 4, 2), (0.25, 0.45, 0.65, 0.75)),
    Engine("m1", "ngram", "i2", 20, 0, 0, (20, 20, 20), (15, 10, 5), (0.55, 0.55, 0.85, 1.0)),
    Engine("m2", "eagle", "i3", 6, 0, 0, (6, 6), (6, 6), (1.0, 1.0)),  # alpha = 1
    Engine("m3", "ngram", "i4", 0, 0, 0, (0, 0), (0, 0)),  # idle: no histogram series
)
RATE_BOUNDS = ("0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1")

# (values for substitute, description)
SCENARIOS = (
    ({}, "all"),
    ({"model": "m1", "instance": "i1"}, "one instance"),
    ({"method": "eagle|ngram", "instance": "i2|i3|i4"}, "two models, some instances"),
    ({"model": "m2|m3", "cost_ratio": "0.3"}, "other cost ratio"),
    ({"model": "nomatch"}, "nothing selected"),
)


def _le(bound: float | str) -> str:
    return "+Inf" if bound == math.inf else str(bound)


def _input_series() -> list[dict[str, str]]:
    out = []

    def add(name: str, labels: dict[str, str], per_minute: float) -> None:
        body = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        out.append({"series": f"{name}{{{body}}}", "values": f"0+{per_minute}x20"})

    for e in ENGINES:
        add("vllm_spec_decode_drafts_total", e.labels, e.drafts)
        add("vllm_spec_decode_empty_proposals_total", e.labels, e.empty)
        add("vllm_spec_decode_padding_tokens_total", e.labels, e.padding)
        for pos in range(e.k):
            pos_labels = {**e.labels, "vllm_spec_decode_position": str(pos)}
            add("vllm_spec_decode_draft_tokens_total", pos_labels, e.drafted[pos])
            add("vllm_spec_decode_accepted_tokens_total", pos_labels, e.accepted[pos])
        if e.drafts:  # a histogram series appears with its first value
            lengths = e.length_counts()
            for bound in [*range(1, e.k + 2), math.inf]:
                cum = sum(n for length, n in lengths.items() if length <= bound)
                add(
                    "vllm_spec_decode_acceptance_length_bucket", {**e.labels, "le": _le(bound)}, cum
                )
            add("vllm_spec_decode_acceptance_length_count", e.labels, e.drafts)
            add(
                "vllm_spec_decode_acceptance_length_sum",
                e.labels,
                sum(length * n for length, n in lengths.items()),
            )
        if e.request_rates:
            for bound in [*RATE_BOUNDS, "+Inf"]:
                cum = sum(1 for r in e.request_rates if r <= float(bound))
                add(
                    "vllm_spec_decode_request_acceptance_rate_bucket",
                    {**e.labels, "le": bound},
                    cum,
                )
            add("vllm_spec_decode_request_acceptance_rate_count", e.labels, len(e.request_rates))
            add("vllm_spec_decode_request_acceptance_rate_sum", e.labels, sum(e.request_rates))
    return out


Key = tuple[tuple[str, str], ...]
Expected = dict[Key, float]


def _key(**labels: str) -> Key:
    return tuple(sorted(labels.items()))


def _mm(e: Engine) -> dict[str, str]:
    return {"gen_ai_request_model": e.model, "vllm_spec_decode_method": e.method}


def _by(engines: Iterable[Engine], keyfn: Callable[[Engine], Key]) -> dict[Key, list[Engine]]:
    groups: dict[Key, list[Engine]] = defaultdict(list)
    for e in engines:
        groups[keyfn(e)].append(e)
    return groups


def _by_mm(engines: Iterable[Engine]) -> dict[Key, list[Engine]]:
    return _by(engines, lambda e: _key(**_mm(e)))


def _per_second(n: float) -> float:
    return n / 60


def _totals(group: list[Engine]) -> dict[str, float]:
    positions = sorted({pos for e in group for pos in range(e.k)})
    return {
        "drafts": _per_second(sum(e.drafts for e in group)),
        "empty": _per_second(sum(e.empty for e in group)),
        "padding": _per_second(sum(e.padding for e in group)),
        "drafted": _per_second(sum(sum(e.drafted) for e in group)),
        "accepted": _per_second(sum(sum(e.accepted) for e in group)),
        # accepted[k-1]: the smallest per-position accepted count
        "fully_accepted": min(
            _per_second(sum(e.accepted[pos] for e in group if pos < e.k)) for pos in positions
        ),
        "k": len(positions),
    }


def _per_group(engines: list[Engine], fn: Callable[[dict[str, float]], float | None]) -> Expected:
    out = {}
    for key, group in _by_mm(engines).items():
        value = fn(_totals(group))
        if value is not None:
            out[key] = value
    return out


def _acceptance_rate(t: dict[str, float]) -> float | None:
    return t["accepted"] / t["drafted"] if t["drafted"] > 0 else None


def _per_token_alpha(t: dict[str, float]) -> float | None:
    """Leviathan's α: accepted / trials. A draft tries positions until its first
    rejection or position k-1: the drafts that stopped at a rejection
    (drafts - accepted[k-1]) tried one more position than they accepted, the
    fully accepted ones tried exactly what they accepted."""
    trials = t["accepted"] + (t["drafts"] - t["fully_accepted"])
    return t["accepted"] / trials if trials > 0 else None


def _leviathan(t: dict[str, float], c: float) -> float | None:
    alpha, k = _per_token_alpha(t), t["k"]
    if alpha is None:
        return None
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    return tokens / (k * c + 1)


def _measured_speedup(t: dict[str, float], c: float) -> float | None:
    if t["drafts"] <= 0:
        return None
    return (1 + t["accepted"] / t["drafts"]) / (t["k"] * c + 1)


def _per_position(engines: list[Engine]) -> Expected:
    out = {}
    for group in _by_mm(engines).values():
        drafts = _per_second(sum(e.drafts for e in group))
        if drafts <= 0:
            continue
        for pos in range(max(e.k for e in group)):
            accepted = _per_second(sum(e.accepted[pos] for e in group if pos < e.k))
            key = _key(**_mm(group[0]), vllm_spec_decode_position=str(pos))
            out[key] = accepted / drafts
    return out


def _length_heatmap(engines: list[Engine]) -> Expected:
    out: dict[Key, float] = defaultdict(float)
    for e in engines:
        if not e.drafts:
            continue
        lengths = e.length_counts()
        for bound in [*range(1, e.k + 2), math.inf]:
            cum = sum(n for length, n in lengths.items() if length <= bound)
            out[_key(le=_le(bound))] += _per_second(cum)
    return dict(out)


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's bucketQuantile for cumulative (upper bound, count) buckets."""
    buckets = sorted(buckets)
    assert buckets[-1][0] == math.inf
    observations = buckets[-1][1]
    rank = q * observations
    b = len(buckets) - 1
    for i, (_, count) in enumerate(buckets[:-1]):
        if count >= rank:
            b = i
            break
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end, count = 0.0, buckets[b][0], buckets[b][1]
    if b > 0:
        start = buckets[b - 1][0]
        count -= buckets[b - 1][1]
        rank -= buckets[b - 1][1]
    return start + (end - start) * (rank / count)


def _request_quantile(q: float) -> Callable[[list[Engine]], Expected]:
    def expected(engines: list[Engine]) -> Expected:
        out = {}
        for key, group in _by_mm(e for e in engines if e.request_rates).items():
            buckets = [
                (
                    float(bound),
                    _per_second(
                        sum(1 for e in group for r in e.request_rates if r <= float(bound))
                    ),
                )
                for bound in [*RATE_BOUNDS, "+Inf"]
            ]
            out[key] = _histogram_quantile(q, buckets)
        return out

    return expected


def _per_instance(engines: list[Engine]) -> Expected:
    out = {}
    for key, group in _by(engines, lambda e: _key(**_mm(e), instance=e.instance)).items():
        value = _acceptance_rate(_totals(group))
        if value is not None:
            out[key] = value
    return out


def _expectations(c: float) -> dict[tuple[str, str], Callable[[list[Engine]], Expected]]:
    """(panel title, refId) -> expected samples for the selected engines."""

    def group(fn: Callable[[dict[str, float]], float | None]):
        return lambda engines: _per_group(engines, fn)

    return {
        ("Acceptance rate", "A"): group(_acceptance_rate),
        ("Mean acceptance length", "A"): group(
            lambda t: 1 + t["accepted"] / t["drafts"] if t["drafts"] > 0 else None
        ),
        ("Per-position acceptance rate", "A"): _per_position,
        ("Per-request acceptance rate (p10 / p50 / p90)", "A"): _request_quantile(0.1),
        ("Per-request acceptance rate (p10 / p50 / p90)", "B"): _request_quantile(0.5),
        ("Per-request acceptance rate (p10 / p50 / p90)", "C"): _request_quantile(0.9),
        ("Acceptance length distribution", "A"): _length_heatmap,
        ("Drafted vs accepted tokens per second", "A"): group(lambda t: t["drafted"]),
        ("Drafted vs accepted tokens per second", "B"): group(lambda t: t["accepted"]),
        ("Drafted vs accepted tokens per second", "C"): group(lambda t: t["padding"]),
        ("Zero-proposal share", "A"): group(
            lambda t: (
                t["empty"] / (t["drafts"] + t["empty"]) if t["drafts"] + t["empty"] > 0 else None
            )
        ),
        ("Expected speedup (Leviathan et al.)", "A"): group(lambda t: _leviathan(t, c)),
        ("Expected speedup (Leviathan et al.)", "B"): group(lambda t: _measured_speedup(t, c)),
        ("System efficiency", "A"): group(
            lambda t: (
                t["accepted"] / (t["k"] * (t["drafts"] + t["empty"]))
                if t["k"] * (t["drafts"] + t["empty"]) > 0
                else None
            )
        ),
        ("Speculative tokens (k)", "A"): group(lambda t: t["k"]),
        ("Acceptance rate by instance", "A"): _per_instance,
    }


ROUND_TO = 1e-6


def _prom_round(value: float) -> float:
    """PromQL's round(v, 1e-6), so that promtool's exact comparison can be used."""
    inverse = 1.0 / ROUND_TO
    return math.floor(value * inverse + 0.5) / inverse


def _selected(values: dict[str, str]) -> list[Engine]:
    def match(pattern: str, value: str) -> bool:
        return re.fullmatch(pattern, value) is not None

    return [
        e
        for e in ENGINES
        if match(values.get("model", ".*"), e.model)
        and match(values.get("method", ".*"), e.method)
        and match(values.get("instance", ".*"), e.instance)
    ]


def test_every_query_has_an_expected_value_model(dashboard: dict) -> None:
    keys = {(p["title"], t["refId"]) for p, t in _targets(dashboard)}
    assert keys == set(_expectations(0.05))


def test_expected_values_sanity() -> None:
    # The synthetic data and the reference formulas agree with docs/metrics.md.
    e1 = ENGINES[0]
    assert sum(e1.length_counts().values()) == e1.drafts
    assert sum((length - 1) * n for length, n in e1.length_counts().items()) == sum(e1.accepted)
    assert _histogram_quantile(0.5, [(0.5, 1.0), (1.0, 3.0), (math.inf, 3.0)]) == 0.625
    t = _totals([ENGINES[2]])  # alpha = 1: the formula's limit
    assert _per_token_alpha(t) == 1
    assert _leviathan(t, 0.05) == pytest.approx(3 / 1.1)
    # i1: drafts reaching length 1, 2, 3, 4 = 3, 3, 2, 2. Trials: 3·1 + 3·2 + 2·3
    # + 2·3 (the 2 fully accepted drafts stop at position k-1 = 2 without a
    # rejection) = 21; accepted = 7 + 4 + 2 = 13.
    e1 = ENGINES[0]
    trials = sum(min(length, e1.k) * n for length, n in e1.length_counts().items())
    assert trials == 21
    t = _totals([e1])
    assert _per_token_alpha(t) == pytest.approx(13 / 21)
    alpha = 13 / 21
    assert _leviathan(t, 0.0) == pytest.approx(1 + alpha + alpha**2 + alpha**3)
    assert _leviathan(t, 0.1) == pytest.approx((1 + alpha + alpha**2 + alpha**3) / 1.3)
    # i1 + i2: accepted 22, 14, 7 per position, drafts 30: alpha = 43 / (43 + 30 - 7).
    t = _totals(list(ENGINES[:2]))
    assert _per_token_alpha(t) == pytest.approx(43 / 66)
    # Not the acceptance rate (accepted / drafted): the data tells them apart.
    rate = _acceptance_rate(t)
    assert rate == pytest.approx(43 / 84)
    assert _leviathan(t, 0.05) - (1 - rate**4) / (1 - rate) / 1.15 > 0.1


def test_queries_evaluate_to_the_metric_definitions(dashboard: dict, tmp_path: Path) -> None:
    """Every dashboard query, through promtool's PromQL engine, on synthetic series."""
    promtool = _promtool()
    queries = [(p["title"], t["refId"], t["expr"]) for p, t in _targets(dashboard)]
    default_c = float(substitute("$cost_ratio"))
    tests = []
    nonempty = 0
    for values, _ in SCENARIOS:
        expectations = _expectations(float(values.get("cost_ratio", default_c)))
        engines = _selected(values)
        expr_tests = []
        for title, ref_id, expr in queries:
            expected = expectations[(title, ref_id)](engines)
            nonempty += bool(expected)
            expr_tests.append(
                {
                    "expr": f"round(\n{substitute(expr, values)}\n, {ROUND_TO})",
                    "eval_time": "10m",
                    "exp_samples": [
                        {
                            "labels": "{" + ", ".join(f'{k}="{v}"' for k, v in key) + "}",
                            "value": _prom_round(value),
                        }
                        for key, value in sorted(expected.items())
                    ],
                }
            )
        tests.append(
            {"interval": "1m", "input_series": _input_series(), "promql_expr_test": expr_tests}
        )
    assert nonempty > len(queries) * 3  # the scenarios exercise every query
    path = tmp_path / "dashboard_test.yml"  # JSON is valid YAML
    path.write_text(
        json.dumps({"rule_files": [], "evaluation_interval": "1m", "tests": tests}, indent=1)
    )
    _assert_promtool_tests_pass(promtool, path)


def _assert_promtool_tests_pass(promtool: str, path: Path) -> None:
    proc = subprocess.run(
        [promtool, "test", "rules", str(path)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-20000:]


RECORDING_RULES = REPO / "collector-config" / "prometheus" / "specdec-recording-rules.yaml"


def _recording_rule(record: str) -> str:
    yaml = pytest.importorskip("yaml")
    groups = yaml.safe_load(RECORDING_RULES.read_text(encoding="utf-8"))["groups"]
    (expr,) = [r["expr"] for g in groups for r in g["rules"] if r.get("record") == record]
    return expr


def test_expected_speedup_agrees_with_the_recording_rule(dashboard: dict, tmp_path: Path) -> None:
    """Panel A and model_method:vllm_spec_decode_expected_speedup:rate5m use the same α.

    The rule's c is 0 for ngram and 0.05 otherwise, so each method is compared
    with that $cost_ratio. Below α = 0.999999 the two are the same expression;
    at α = 1 the rule's cap leaves it within 5e-5 (relative) of the panel's limit.
    """
    promtool = _promtool()
    rule = _recording_rule("model_method:vllm_spec_decode_expected_speedup:rate5m")
    panel = next(
        t["expr"]
        for p, t in _targets(dashboard)
        if p["title"] == "Expected speedup (Leviathan et al.)" and t["refId"] == "A"
    )
    cases = (  # (values, tolerance, the (model, method) compared)
        ({"method": "ngram", "cost_ratio": "0"}, "1e-12", ("m1", "ngram")),  # alpha = 43/66
        ({"method": "eagle", "cost_ratio": "0.05"}, "1e-4", ("m2", "eagle")),  # alpha = 1
    )
    expr_tests = [
        {
            "expr": (
                f"abs(\n({substitute(panel, values)})\n-\n({rule})\n)\n"
                f"<= bool {tolerance} * (\n{rule}\n)"
            ),
            "eval_time": "10m",
            "exp_samples": [
                {
                    "labels": f'{{gen_ai_request_model="{model}", '
                    f'vllm_spec_decode_method="{method}"}}',
                    "value": 1,
                }
            ],
        }
        for values, tolerance, (model, method) in cases
    ]
    path = tmp_path / "agree_test.yml"  # JSON is valid YAML
    path.write_text(
        json.dumps(
            {
                "rule_files": [],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": _input_series(),
                        "promql_expr_test": expr_tests,
                    }
                ],
            },
            indent=1,
        )
    )
    _assert_promtool_tests_pass(promtool, path)
