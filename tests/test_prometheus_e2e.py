"""From the engine to the dashboard, with real parts: vLLM (CPU build, tiny
model, ngram, engine core in its own process) with the plugin serving
/metrics (``OTEL_METRICS_EXPORTER=prometheus``), a real Prometheus scraping
it every second and evaluating the shipped recording rules. Every PromQL
expression of the dashboard and of the recording rules is then evaluated
through Prometheus's HTTP API and compared with numbers computed from
vLLM's own counters for the same run.

Rates are taken over a window that holds the whole run, and every
expectation is a ratio of two rates over the same samples, so Prometheus'
extrapolation cancels and the comparisons are exact (to float rounding).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from fault_helpers import EngineChild, clean_env, free_port
from prometheus_server import PrometheusServer, values

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
RECORDING_RULES = ROOT / "collector-config" / "prometheus" / "specdec-recording-rules.yaml"
DASHBOARD = ROOT / "dashboards" / "otel-specdec.json"
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
# Holds the whole run (engine start-up included) in every rate window.
WINDOW = "10m"


@dataclass
class LiveRun:
    prometheus: PrometheusServer
    vllm: dict[str, Any]
    # The plugin's own counters as Prometheus last scraped them.
    empty_proposals: float
    at: float

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.prometheus.query(expr, at=self.at)


@pytest.fixture(scope="module")
def live(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    port = free_port()
    workdir = tmp_path_factory.mktemp("prometheus")
    with PrometheusServer(workdir, [f"127.0.0.1:{port}"], [RECORDING_RULES]) as prometheus:
        child = EngineChild(
            {"model": tiny_model, "speculative_config": NGRAM, "hold": True, "max_tokens": 48},
            clean_env(OTEL_METRICS_EXPORTER="prometheus",
                      OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
                      OTEL_EXPORTER_PROMETHEUS_PORT=str(port)))
        try:
            child.wait_pause()  # engine up, nothing generated yet
            # Zero samples first, so that rate() sees the whole increase.
            prometheus.wait_for("count_over_time(vllm_spec_decode_drafts_total[5m])",
                                lambda r: r and values(r)[0] >= 2)
            child.proceed()
            vllm = child.wait_pause()  # generated; the engine idles, still serving
            assert vllm["drafts"] > 0
            prometheus.wait_for("vllm_spec_decode_drafts_total",
                                lambda r: values(r) == [vllm["drafts"]])
            # A few more scrapes and rule evaluations on the final values.
            time.sleep(3)
            at = time.time()
            [empty] = values(prometheus.query("vllm_spec_decode_empty_proposals_total", at))
            yield LiveRun(prometheus, vllm, empty, at)
            child.proceed()
            child.result()
        finally:
            child.kill()


def expected_numbers(run: LiveRun, cost_ratio: float) -> dict[str, float]:
    """What the queries must return, from vLLM's counters (and, for the
    empty proposals vLLM does not count, the plugin's scraped counter)."""
    vllm = run.vllm
    drafts, drafted, accepted = vllm["drafts"], vllm["draft_tokens"], vllm["accepted_tokens"]
    alpha = per_token_alpha(run)
    steps = drafts + run.empty_proposals
    return {
        "acceptance_rate": accepted / drafted,
        "mean_acceptance_length": 1 + accepted / drafts,
        "zero_proposal_share": run.empty_proposals / steps,
        "system_efficiency": accepted / (K * steps),
        # Leviathan et al. with their per-token α (not the acceptance rate).
        "expected_speedup": (1 - alpha ** (K + 1)) / ((1 - alpha) * (K * cost_ratio + 1)),
        "k": K,
    }


def per_position(run: LiveRun) -> list[float]:
    return [a / run.vllm["drafts"] for a in run.vllm["accepted_per_pos"]]


def assert_close(actual: list[float], expected: list[float] | float, what: str) -> None:
    expected = expected if isinstance(expected, list) else [expected]
    assert len(actual) == len(expected), (what, actual, expected)
    for got, want in zip(sorted(actual), sorted(expected), strict=True):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), (what, actual, expected)


def recording_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RECORDING_RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "record" in rule]


def with_window(expr: str) -> str:
    return expr.replace("[5m]", f"[{WINDOW}]")


# Every expression shipped must have an expectation here: a new rule or
# panel without one fails the test until its meaning is checked.
Check = Callable[[LiveRun, list[dict[str, Any]]], None]


def series_by(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    return {sample["metric"].get(label, ""): float(sample["value"][1]) for sample in result}


def prometheus_quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile on (upper bound, cumulative count) pairs,
    +Inf last: linear interpolation inside the bucket that holds the rank."""
    total = cumulative[-1][1]
    rank = q * total
    index = next(i for i, (_, count) in enumerate(cumulative) if count >= rank)
    if index == len(cumulative) - 1:
        return cumulative[-2][0]
    upper, count = cumulative[index]
    if index == 0 and upper <= 0:
        return upper
    lower, below = cumulative[index - 1] if index > 0 else (0.0, 0.0)
    return lower + (upper - lower) * (rank - below) / (count - below)


def scraped_buckets(run: LiveRun, metric: str) -> list[tuple[float, float]]:
    """The plugin's final bucket counts, as Prometheus scraped them (the
    series were at zero before the run, so these are the run's increases)."""
    by_le = series_by(run.query(f"sum by (le) ({metric})"), "le")
    return sorted(((float(le), count) for le, count in by_le.items()), key=lambda p: p[0])


def length_distribution(run: LiveRun) -> dict[float, float]:
    """Cumulative share of drafts with acceptance length <= le, from vLLM's
    per-position counters: drafts accepting exactly a tokens are
    accepted_pos[a-1] - accepted_pos[a]."""
    drafts, per_pos = run.vllm["drafts"], run.vllm["accepted_per_pos"]
    reached = [drafts, *per_pos, 0]  # drafts that accepted at least a tokens
    exactly = [reached[a] - reached[a + 1] for a in range(K + 1)]
    out = {math.inf: 1.0}
    for length in range(1, K + 2):
        out[float(length)] = sum(exactly[:length]) / drafts
    return out


def dashboard_targets() -> list[tuple[str, str, str]]:
    from tools.dashboard_queries import iter_panels, load_dashboard, substitute

    dashboard = load_dashboard(DASHBOARD)
    return [(panel["title"], target["refId"],
             substitute(target["expr"], {"__rate_interval": WINDOW}, dashboard=dashboard))
            for panel in iter_panels(dashboard["panels"])
            for target in panel.get("targets", []) if target.get("expr")]


def cost_ratio_default() -> float:
    from tools.dashboard_queries import load_dashboard, variable_defaults

    return float(variable_defaults(load_dashboard(DASHBOARD))["cost_ratio"])


def test_every_dashboard_query_matches_vllm(live: LiveRun):
    numbers = expected_numbers(live, cost_ratio_default())
    results = {(title, ref): live.query(expr) for title, ref, expr in dashboard_targets()}
    assert results, "the dashboard has no queries"
    for (title, ref), result in results.items():
        assert result, f"{title} [{ref}] returned nothing"
    one = {key: values(result) for key, result in results.items()}
    rate_q, rate_buckets = "Per-request acceptance rate (p10 / p50 / p90)", scraped_buckets(
        live, "vllm_spec_decode_request_acceptance_rate_bucket")
    drafted_per_s = one[("Drafted vs accepted tokens per second", "A")][0]
    [padding] = values(live.query("vllm_spec_decode_padding_tokens_total"))
    expected: dict[tuple[str, str], Callable[[], None]] = {
        ("Acceptance rate", "A"): lambda: assert_close(
            one[("Acceptance rate", "A")], numbers["acceptance_rate"], "acceptance rate"),
        ("Mean acceptance length", "A"): lambda: assert_close(
            one[("Mean acceptance length", "A")], numbers["mean_acceptance_length"], "length"),
        ("Per-position acceptance rate", "A"): lambda: assert_close(
            one[("Per-position acceptance rate", "A")], per_position(live), "per position"),
        **{(rate_q, ref): (lambda ref=ref, q=q: assert_close(
            one[(rate_q, ref)], prometheus_quantile(q, rate_buckets), f"p{q}"))
           for ref, q in (("A", 0.1), ("B", 0.5), ("C", 0.9))},
        ("Acceptance length distribution", "A"): lambda: check_length_heatmap(
            live, results[("Acceptance length distribution", "A")]),
        ("Drafted vs accepted tokens per second", "A"): lambda: assert_close(
            [drafted_per_s * live.vllm["accepted_tokens"] / live.vllm["draft_tokens"]],
            one[("Drafted vs accepted tokens per second", "B")][0], "drafted vs accepted"),
        ("Drafted vs accepted tokens per second", "B"): lambda: None,  # with A
        ("Drafted vs accepted tokens per second", "C"): lambda: assert_close(
            one[("Drafted vs accepted tokens per second", "C")],
            drafted_per_s * padding / live.vllm["draft_tokens"], "padding per second"),
        ("Zero-proposal share", "A"): lambda: assert_close(
            one[("Zero-proposal share", "A")], numbers["zero_proposal_share"], "zero share"),
        ("Expected speedup (Leviathan et al.)", "A"): lambda: assert_close(
            one[("Expected speedup (Leviathan et al.)", "A")], numbers["expected_speedup"],
            "expected speedup"),
        ("Expected speedup (Leviathan et al.)", "B"): lambda: assert_close(
            one[("Expected speedup (Leviathan et al.)", "B")],
            numbers["mean_acceptance_length"] / (K * cost_ratio_default() + 1),
            "measured speedup"),
        ("System efficiency", "A"): lambda: assert_close(
            one[("System efficiency", "A")], numbers["system_efficiency"], "efficiency"),
        ("Speculative tokens (k)", "A"): lambda: assert_close(
            one[("Speculative tokens (k)", "A")], float(K), "k"),
        ("Acceptance rate by instance", "A"): lambda: assert_close(
            one[("Acceptance rate by instance", "A")], numbers["acceptance_rate"],
            "per instance"),
    }
    assert set(results) == set(expected), (
        "queries without an expectation", set(results) - set(expected),
        "expectations without a query", set(expected) - set(results))
    assert 0 < numbers["acceptance_rate"] < 1  # a run with both outcomes
    for key in results:
        expected[key]()


def check_length_heatmap(run: LiveRun, result: list[dict[str, Any]]) -> None:
    by_le = {float(le): v for le, v in series_by(result, "le").items()}
    total = by_le[math.inf]
    shares = {le: count / total for le, count in by_le.items()}
    want = length_distribution(run)
    assert set(shares) == set(want), (shares, want)
    for le in want:
        assert math.isclose(shares[le], want[le], rel_tol=1e-9), (le, shares, want)


def per_token_alpha(run: LiveRun) -> float:
    """Leviathan's per-token acceptance, estimated from the accepted prefix:
    successes / trials, a draft's trial ending at its first rejection (drafts
    that accepted all k tokens had none)."""
    vllm = run.vllm
    accepted, drafts = vllm["accepted_tokens"], vllm["drafts"]
    return accepted / (accepted + drafts - vllm["accepted_per_pos"][K - 1])


def conditional_per_position(run: LiveRun) -> list[float]:
    reached = [run.vllm["drafts"], *run.vllm["accepted_per_pos"]]
    return [reached[i + 1] / reached[i] for i in range(K) if reached[i] > 0]


def rule_checks(run: LiveRun, rule_value: Callable[[str], list[float]]
                ) -> dict[str, Callable[[], None]]:
    vllm = run.vllm
    drafted, accepted, drafts = vllm["draft_tokens"], vllm["accepted_tokens"], vllm["drafts"]
    numbers = expected_numbers(run, cost_ratio=0.0)  # the rules' c for ngram
    alpha = per_token_alpha(run)
    mm = "model_method:vllm_spec_decode_"

    def per_second_of(name: str, share: float) -> None:
        # Rates in tokens/s: checked as shares of the drafted-token rate.
        [base] = rule_value(f"{mm}draft_tokens:rate5m")
        assert base > 0
        assert_close(rule_value(name), base * share, name)

    return {
        f"{mm}draft_tokens:rate5m": lambda: per_second_of(f"{mm}draft_tokens:rate5m", 1.0),
        f"{mm}accepted_tokens:rate5m": lambda: per_second_of(
            f"{mm}accepted_tokens:rate5m", accepted / drafted),
        f"{mm}drafts:rate5m": lambda: per_second_of(f"{mm}drafts:rate5m", drafts / drafted),
        f"{mm}acceptance_rate:rate5m": lambda: assert_close(
            rule_value(f"{mm}acceptance_rate:rate5m"), numbers["acceptance_rate"], "rate"),
        "instance_model_method:vllm_spec_decode_acceptance_rate:rate5m": lambda: assert_close(
            rule_value("instance_model_method:vllm_spec_decode_acceptance_rate:rate5m"),
            numbers["acceptance_rate"], "instance rate"),
        f"{mm}mean_acceptance_length:rate5m": lambda: assert_close(
            rule_value(f"{mm}mean_acceptance_length:rate5m"),
            numbers["mean_acceptance_length"], "length"),
        "model_method_position:vllm_spec_decode_acceptance_rate:rate5m": lambda: assert_close(
            rule_value("model_method_position:vllm_spec_decode_acceptance_rate:rate5m"),
            per_position(run), "per position"),
        "model_method_position:vllm_spec_decode_conditional_acceptance_rate:rate5m":
            lambda: assert_close(rule_value(
                "model_method_position:vllm_spec_decode_conditional_acceptance_rate:rate5m"),
                conditional_per_position(run), "conditional per position"),
        f"{mm}conditional_acceptance_rate:rate5m": lambda: assert_close(
            rule_value(f"{mm}conditional_acceptance_rate:rate5m"), alpha, "per-token alpha"),
        f"{mm}zero_proposal_share:rate5m": lambda: assert_close(
            rule_value(f"{mm}zero_proposal_share:rate5m"), numbers["zero_proposal_share"],
            "zero share"),
        f"{mm}draft_positions:count": lambda: assert_close(
            rule_value(f"{mm}draft_positions:count"), float(K), "k"),
        f"{mm}system_efficiency:rate5m": lambda: assert_close(
            rule_value(f"{mm}system_efficiency:rate5m"), numbers["system_efficiency"],
            "efficiency"),
        f"{mm}expected_speedup:rate5m": lambda: assert_close(
            rule_value(f"{mm}expected_speedup:rate5m"),
            numbers["expected_speedup"], "expected speedup (c = 0 for ngram)"),
    }


@pytest.mark.parametrize("source", ["expression", "recorded series"])
def test_every_recording_rule_matches_vllm(live: LiveRun, source: str):
    """Each rule's expression sent to the HTTP API, and the series Prometheus
    recorded from it (the rule file loaded, evaluated every second)."""
    rules = {rule["record"]: rule["expr"] for rule in recording_rules()}

    def rule_value(name: str) -> list[float]:
        result = live.query(rules[name] if source == "expression" else name)
        assert result, f"{name} ({source}) returned nothing"
        return values(result)

    checks = rule_checks(live, rule_value)
    assert set(rules) == set(checks), (
        "rules without an expectation", set(rules) - set(checks),
        "expectations without a rule", set(checks) - set(rules))
    for name in rules:
        checks[name]()
