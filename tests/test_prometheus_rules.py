"""Prometheus rules, alerts and scrape config in collector-config/prometheus.

promtool checks the config and both rule files and runs the rule unit
tests in collector-config/prometheus/tests/. The YAML checks make sure
every alert is tested both firing and silent and every recording rule is
checked numerically. The mutation tests break one guard of an alert at a
time and expect the unit tests to notice, so a unit test that no longer
exercises that guard fails here.

Without promtool the promtool tests are skipped, except under CI=true,
where they fail (CI installs promtool).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

PROM_DIR = Path(__file__).resolve().parent.parent / "collector-config" / "prometheus"
CONFIG = PROM_DIR / "prometheus.yml"
RECORDING_RULES = PROM_DIR / "specdec-recording-rules.yaml"
ALERT_RULES = PROM_DIR / "specdec-alert-rules.yaml"
RULE_FILES = (RECORDING_RULES, ALERT_RULES)
UNIT_TESTS = sorted((PROM_DIR / "tests").glob("*.yaml"))

RECORD_NAME = re.compile(
    r"^(instance_)?model_method(_position)?:vllm_spec_decode_[a-z0-9_]+:[a-z0-9_]+$"
)


def _load(path: Path) -> Any:
    with path.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def _rules(path: Path) -> list[dict[str, Any]]:
    return [rule for group in _load(path)["groups"] for rule in group["rules"]]


def _records() -> list[dict[str, Any]]:
    return [rule for rule in _rules(RECORDING_RULES) if "record" in rule]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules(ALERT_RULES) if "alert" in rule]


def _unit_test_groups() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, group) for path in UNIT_TESTS for group in _load(path)["tests"]]


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool (from Prometheus, e.g. Debian's `prometheus` package) is not on PATH"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"{reason}; CI={os.environ['CI']} requires it")
        pytest.skip(reason)
    return path


def _run(*args: str | Path, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(arg) for arg in args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


# ---------------------------------------------------------------- promtool


def test_promtool_check_config(promtool: str) -> None:
    result = _run(promtool, "check", "config", CONFIG)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "SUCCESS: 2 rule files found" in output, output
    # check config also checks the rule files it loads, by relative path.
    for path in RULE_FILES:
        assert f"Checking {path.name}" in output or f"Checking {path}" in output, output


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(promtool: str, path: Path) -> None:
    result = _run(promtool, "check", "rules", path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"SUCCESS: {len(_rules(path))} rules found" in output, output


def test_promtool_rule_unit_tests(promtool: str) -> None:
    assert UNIT_TESTS, "no promtool unit tests in collector-config/prometheus/tests"
    result = _run(promtool, "test", "rules", *UNIT_TESTS, cwd=PROM_DIR / "tests")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "FAILED" not in output, output
    assert output.count("SUCCESS") == len(UNIT_TESTS), output


# ------------------------------------------------------- coverage and shape


def test_unit_tests_load_the_shipped_rule_files() -> None:
    loaded: set[Path] = set()
    for path in UNIT_TESTS:
        for rule_file in _load(path)["rule_files"]:
            resolved = (path.parent / rule_file).resolve()
            assert resolved.is_file(), f"{path.name}: {rule_file} does not exist"
            loaded.add(resolved)
    assert loaded == {p.resolve() for p in RULE_FILES}


def test_every_alert_is_tested_firing_and_silent() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for _path, group in _unit_test_groups():
        for case in group.get("alert_rule_test") or []:
            (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    names = {rule["alert"] for rule in _alerts()}
    assert len(names) == 3
    assert names - firing == set(), "alerts never tested firing"
    assert names - silent == set(), "alerts never tested silent"
    assert (firing | silent) - names == set(), "tests name alerts that do not exist"


def test_every_recording_rule_is_checked_numerically() -> None:
    checked: set[str] = set()
    for _path, group in _unit_test_groups():
        for case in group.get("promql_expr_test") or []:
            if not case.get("exp_samples"):
                continue
            checked.update(re.findall(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", case["expr"]))
    names = {rule["record"] for rule in _records()}
    assert names - checked == set(), "recording rules without a numeric promtool check"


def test_recording_rules_are_named_and_aggregated_by_model_and_method() -> None:
    records = _records()
    names = [rule["record"] for rule in records]
    assert len(names) == len(set(names)), "duplicate recording rule names"
    for rule in records:
        name, expr = rule["record"], rule["expr"]
        assert RECORD_NAME.match(name), f"{name}: not level:metric:operations"
        assert "gen_ai_request_model, vllm_spec_decode_method" in expr, name
        if name.endswith(":rate5m"):
            windows = set(re.findall(r"\[(\d+[smhdwy])\]", expr))
            assert windows == {"5m"}, f"{name}: range windows {windows}"


def test_expressions_are_self_contained() -> None:
    """No rule reads another rule's output; each one evaluates on its own."""
    recorded = {rule["record"] for rule in _records()}
    for rule in _records() + _alerts():
        used = set(re.findall(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", rule["expr"]))
        name = rule.get("record") or rule["alert"]
        assert not used & recorded, f"{name} reads recording rules {used & recorded}"


def test_alerts_have_for_severity_and_annotations() -> None:
    for rule in _alerts():
        name = rule["alert"]
        assert re.fullmatch(r"\d+m", rule.get("for", "")), f"{name}: no for:"
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), name
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook"} <= set(annotations), name
        assert "$labels." in annotations["summary"] + annotations["description"], name
        assert "$value" in annotations["description"], name
        assert f"docs/prometheus-rules.md, section {name}" in annotations["runbook"], name


def test_config_loads_both_rule_files_by_relative_path() -> None:
    config = _load(CONFIG)
    assert config["rule_files"] == [p.name for p in RULE_FILES]
    targets = [
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    assert "localhost:9464" in targets


def test_reference_page_covers_every_rule() -> None:
    page = (PROM_DIR.parent.parent / "docs" / "prometheus-rules.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", page, re.MULTILINE)
    assert headings and headings[0] == "Limitations", "the page must open with its limitations"
    for rule in _records():
        assert f"`{rule['record']}`" in page, rule["record"]
    for rule in _alerts():
        assert f"### {rule['alert']}" in page, rule["alert"]


# ------------------------------------------------------------- mutations


def _naive_position_rule(expr: str) -> str:
    """The per-position rate accepted[i] / drafts against its mean: no prefix correction."""
    labels = "gen_ai_request_model, vllm_spec_decode_method"
    return (
        f"sum by ({labels}, vllm_spec_decode_position)"
        " (rate(vllm_spec_decode_accepted_tokens_total[5m]))"
        f" / on ({labels}) group_left ()"
        f" sum by ({labels}) (rate(vllm_spec_decode_drafts_total[5m]))"
        f" / on ({labels}) group_left ()"
        f" avg by ({labels}) ("
        f"sum by ({labels}, vllm_spec_decode_position)"
        " (rate(vllm_spec_decode_accepted_tokens_total[5m]))"
        f" / on ({labels}) group_left ()"
        f" sum by ({labels}) (rate(vllm_spec_decode_drafts_total[5m]))"
        ") < 0.5"
    )


def _replace_once(old: str, new: str) -> Callable[[str], str]:
    def mutate(expr: str) -> str:
        assert expr.count(old) == 1, f"{old!r} is not in the expression exactly once"
        return expr.replace(old, new)

    return mutate


MUTATIONS = {
    # name: (alert, mutation of its expr, unit-test file, series that must then fire)
    "collapse-without-traffic-guard": (
        "SpecDecodeAcceptanceCollapse",
        _replace_once(") >= 1\n", ") >= 0\n"),
        "acceptance-collapse-test.yaml",
        "trickle",
    ),
    "collapse-without-baseline-guard": (
        "SpecDecodeAcceptanceCollapse",
        _replace_once(") >= 1000", ") >= 0"),
        "acceptance-collapse-test.yaml",
        "thin-baseline",
    ),
    "no-drafts-without-minimum": (
        "SpecDecodeNoDrafts",
        _replace_once(") >= 60", ") >= 0"),
        "no-drafts-test.yaml",
        "trickle",
    ),
    "outlier-without-traffic-guard": (
        "SpecDecodePositionAcceptanceOutlier",
        _replace_once(") >= 0.5", ") >= 0"),
        "position-outlier-test.yaml",
        "low-traffic",
    ),
    "outlier-on-raw-per-position-rate": (
        "SpecDecodePositionAcceptanceOutlier",
        _naive_position_rule,
        "position-outlier-test.yaml",
        "geometric",
    ),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_unit_tests_catch_a_broken_alert(promtool: str, tmp_path: Path, mutation: str) -> None:
    alert, mutate, test_file, must_fire = MUTATIONS[mutation]
    copy = tmp_path / "prometheus"
    shutil.copytree(PROM_DIR, copy)
    rules = _load(ALERT_RULES)
    (target,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alert]
    target["expr"] = mutate(target["expr"])
    (copy / ALERT_RULES.name).write_text(yaml.safe_dump(rules, sort_keys=False), "utf-8")

    # The mutated rules are still valid, so only the unit test can object.
    checked = _run(promtool, "check", "rules", copy / ALERT_RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    result = _run(promtool, "test", "rules", test_file, cwd=copy / "tests")
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"{test_file} passes with {mutation}:\n{output}"
    assert f'gen_ai_request_model="{must_fire}"' in output or f'instance="{must_fire}"' in output, (
        output
    )
