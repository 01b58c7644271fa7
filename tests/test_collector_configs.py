"""The shipped collector configurations (``collector-config/``) are consistent.

No OpenTelemetry Collector binary is available to the tests, so
``otelcol-contrib validate`` cannot run here. These tests parse every
``otelcol-*.yaml`` (and each overlay merged on top, the way the collector
merges several ``--config`` files) and enforce what the collector, the
backends and our docs require. Every check also runs on a broken copy of a
shipped file, so a check that stopped catching its problem fails too.

``rotel.env`` is sourced as the docs say, its variable names are compared
with ``rotel-agent start --help``, and rotel-agent is started with it.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from rotel_helpers import (
    CONFIG_DIR,
    ROTEL_ENV,
    RotelAgent,
    accepted_variables,
    base_env,
    require_rotel_agent,
    source_env_file,
)

from otel_specdec.demo.receiver import OtlpReceiver

KINDS = ("receivers", "processors", "exporters", "connectors", "extensions")
SIGNALS = {"metrics", "traces", "logs"}

# Component types of the contrib distribution that these configs may use: a
# typo (memorylimiter, prometheus_remote_write) fails here, not at start-up.
KNOWN_TYPES = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "batch", "resource", "resourcedetection", "transform",
                   "attributes", "filter", "deltatocumulative", "cumulativetodelta"},
    "exporters": {"otlp", "otlphttp", "prometheusremotewrite", "prometheus", "debug",
                  "loadbalancing"},
    "connectors": set(),
    "extensions": {"health_check", "basicauth", "bearertokenauth", "oauth2client",
                   "headers_setter", "pprof", "zpages"},
}
PROMETHEUS_EXPORTERS = {"prometheusremotewrite", "prometheus"}

# What the engines feed each file. The gateway is documented for the
# plugin's default temporality, the delta gateway for delta; the agent
# forwards whatever it gets, so it must be safe for both. A new file must
# be added here.
INPUT_TEMPORALITY = {
    "otelcol-gateway.yaml": "cumulative",
    "otelcol-agent.yaml": "any",
    "otelcol-delta.yaml": "delta",
}

ENV_REF = re.compile(r"\$\{env:(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")
ANY_REF = re.compile(r"\$\{[^}]*\}")
# A listen address (or local URL) that names no real host.
LOCAL_ADDRESS = re.compile(
    r"(?:https?://)?(?:localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\]|\[::\]):\d{1,5}(?:/\S*)?")
# A host or URL written out literally.
LITERAL_ADDRESS = re.compile(
    r"://|\b\d{1,3}(?:\.\d{1,3}){3}\b|\b[a-z0-9-]+(?:\.[a-z0-9-]+)*:\d{2,5}\b", re.IGNORECASE)
SECRET_WORDS = ("password", "username", "token", "secret", "api_key", "apikey",
                "authorization", "credential")


# --------------------------------------------------------------------------
# Loading


def load(path: Path) -> dict[str, Any]:
    cfg = yaml.safe_load(path.read_text())
    assert isinstance(cfg, dict), f"{path.name}: not a YAML mapping"
    return cfg


def merge(base: Any, overlay: Any) -> Any:
    """The collector's merge of several --config files: mappings merge
    recursively, anything else (lists included) is replaced."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        merged = dict(base)
        for key, value in overlay.items():
            merged[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    return copy.deepcopy(overlay)


BASE_FILES = sorted(CONFIG_DIR.glob("otelcol-*.yaml"))
OVERLAY_FILES = sorted((CONFIG_DIR / "overlays").glob("*.yaml"))


def shipped_configs() -> dict[str, tuple[dict[str, Any], str, str]]:
    """name -> (config, the files' text, input temporality): every base
    file, and every overlay merged onto every base that exports to
    Prometheus remote write."""
    configs = {}
    for path in BASE_FILES:
        temporality = INPUT_TEMPORALITY.get(path.name, "any")
        configs[path.name] = (load(path), path.read_text(), temporality)
        if "prometheusremotewrite" not in (configs[path.name][0].get("exporters") or {}):
            continue
        for overlay in OVERLAY_FILES:
            name = f"{path.name}+overlays/{overlay.name}"
            configs[name] = (merge(load(path), load(overlay)),
                             path.read_text() + overlay.read_text(), temporality)
    return configs


CONFIGS = shipped_configs()


def config(name: str) -> dict[str, Any]:
    return copy.deepcopy(CONFIGS[name][0])


# --------------------------------------------------------------------------
# The checks: each returns the problems it finds, [] when the config is fine.


def component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def pipelines(cfg: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    return (cfg.get("service") or {}).get("pipelines") or {}


def leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from leaves(value, (*path, index))
    else:
        yield path, node


def definition_problems(cfg: dict[str, Any]) -> list[str]:
    """Every component named in service is defined, with a known type."""
    problems = []
    for kind in KINDS:
        for component_id in cfg.get(kind) or {}:
            if component_type(component_id) not in KNOWN_TYPES[kind]:
                problems.append(f"{kind}.{component_id}: unknown {kind[:-1]} type")
    service = cfg.get("service") or {}
    enabled_extensions = service.get("extensions") or []
    for extension in enabled_extensions:
        if extension not in (cfg.get("extensions") or {}):
            problems.append(f"service.extensions: {extension} is not defined")
    if not pipelines(cfg):
        problems.append("service.pipelines: none")
    where = {"receivers": ("receivers", "connectors"), "processors": ("processors",),
             "exporters": ("exporters", "connectors")}
    for pipeline_id, pipeline in pipelines(cfg).items():
        if component_type(pipeline_id) not in SIGNALS:
            problems.append(f"pipeline {pipeline_id}: unknown signal")
        for role in ("receivers", "exporters"):
            if not pipeline.get(role):
                problems.append(f"pipeline {pipeline_id}: no {role}")
        for role, kinds in where.items():
            names = pipeline.get(role) or []
            if len(names) != len(set(names)):
                problems.append(f"pipeline {pipeline_id}: {role} listed twice")
            for name in names:
                if not any(name in (cfg.get(kind) or {}) for kind in kinds):
                    problems.append(f"pipeline {pipeline_id}: {role[:-1]} {name} is not defined")
    # An exporter's or receiver's auth must name an extension that is started.
    for path, value in leaves(cfg):
        if path and path[-1] == "authenticator" and value not in enabled_extensions:
            problems.append(f"{'.'.join(map(str, path))}: {value} is not in service.extensions")
    return problems


def unused_problems(cfg: dict[str, Any]) -> list[str]:
    """Every defined component is used by a pipeline (extensions: started)."""
    used: dict[str, set[str]] = {kind: set() for kind in KINDS}
    used["extensions"] = set((cfg.get("service") or {}).get("extensions") or [])
    for pipeline in pipelines(cfg).values():
        for role in ("receivers", "processors", "exporters"):
            for name in pipeline.get(role) or []:
                used[role].add(name)
    connectors_used = used["receivers"] & used["exporters"]
    problems = []
    for kind in KINDS:
        for component_id in cfg.get(kind) or {}:
            in_use = (component_id in connectors_used if kind == "connectors"
                      else component_id in used[kind])
            if not in_use:
                problems.append(f"{kind}.{component_id} is defined but not used")
    return problems


def processor_order_problems(cfg: dict[str, Any]) -> list[str]:
    """Every pipeline has memory_limiter, first, and batch after it."""
    problems = []
    for pipeline_id, pipeline in pipelines(cfg).items():
        types = [component_type(p) for p in pipeline.get("processors") or []]
        if "memory_limiter" not in types:
            problems.append(f"pipeline {pipeline_id}: no memory_limiter")
        elif types[0] != "memory_limiter":
            problems.append(f"pipeline {pipeline_id}: memory_limiter is not first")
        if "batch" not in types:
            problems.append(f"pipeline {pipeline_id}: no batch")
        elif "memory_limiter" in types and types.index("batch") < types.index("memory_limiter"):
            problems.append(f"pipeline {pipeline_id}: batch before memory_limiter")
    return problems


def _is_secret(key: str) -> bool:
    return any(word in key.lower() for word in SECRET_WORDS)


def _is_address(key: str) -> bool:
    key = key.lower()
    return key == "endpoint" or key.endswith(("_endpoint", "url"))


def literal_problems(cfg: dict[str, Any]) -> list[str]:
    """No credential or host written into the file: secrets and header
    values are one ${env:VAR} with no default, addresses are ${env:VAR}
    with at most a loopback/0.0.0.0 default, and nothing else spells out a
    host or URL."""
    problems = []
    for path, value in leaves(cfg):
        where = ".".join(map(str, path))
        key = next((p for p in reversed(path) if isinstance(p, str)), "")
        sensitive = _is_secret(key) or "headers" in path
        if not isinstance(value, str):
            if (sensitive or _is_address(key)) and value is not None:
                problems.append(f"{where}: literal {value!r}")
            continue
        for ref in ANY_REF.findall(value):
            if not ENV_REF.fullmatch(ref):
                problems.append(f"{where}: {ref} is not an ${{env:VAR}} reference")
        rest = ANY_REF.sub("", value)
        if "$" in rest:
            problems.append(f"{where}: bare $ (use ${{env:VAR}})")
        whole = ENV_REF.fullmatch(value)
        if sensitive:
            if whole is None:
                problems.append(f"{where}: credential not taken from ${{env:VAR}}")
            elif whole["default"] is not None:
                problems.append(f"{where}: credential with a default")
        elif _is_address(key):
            if whole is None:
                problems.append(f"{where}: address not taken from ${{env:VAR}}")
            elif whole["default"] is not None and not LOCAL_ADDRESS.fullmatch(whole["default"]):
                problems.append(f"{where}: default {whole['default']!r} names a host")
        if LITERAL_ADDRESS.search(rest):
            problems.append(f"{where}: literal address {value!r}")
    return problems


def temporality_problems(cfg: dict[str, Any], input_temporality: str) -> list[str]:
    """No Prometheus exporter gets delta data: the temporality is followed
    through each metrics pipeline's processors ("any" input counts as delta)."""
    problems = []
    for pipeline_id, pipeline in pipelines(cfg).items():
        if component_type(pipeline_id) != "metrics":
            continue
        state = "cumulative" if input_temporality == "cumulative" else "delta"
        for processor in pipeline.get("processors") or []:
            if component_type(processor) == "cumulativetodelta":
                state = "delta"
            elif component_type(processor) == "deltatocumulative":
                state = "cumulative"
        for exporter in pipeline.get("exporters") or []:
            if component_type(exporter) in PROMETHEUS_EXPORTERS and state != "cumulative":
                problems.append(f"pipeline {pipeline_id}: {exporter} receives delta data "
                                "(no deltatocumulative before it)")
    return problems


def undocumented_variables(text: str) -> list[str]:
    """Every environment variable the YAML reads is named in its comments."""
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    names = {m["name"] for m in ENV_REF.finditer(code)}
    return sorted(f"{name} is read but not documented" for name in names
                  if not re.search(rf"\b{name}\b", comments))


Entry = tuple[dict[str, Any], str, str]  # config, the files' text, input temporality

CHECKS: dict[str, Callable[[Entry], list[str]]] = {
    "defined": lambda entry: definition_problems(entry[0]),
    "used": lambda entry: unused_problems(entry[0]),
    "processor_order": lambda entry: processor_order_problems(entry[0]),
    "no_literals": lambda entry: literal_problems(entry[0]),
    "temporality": lambda entry: temporality_problems(entry[0], entry[2]),
    "documented": lambda entry: undocumented_variables(entry[1]),
}


# --------------------------------------------------------------------------
# The shipped files pass


def test_expected_files_are_shipped():
    assert {p.name for p in BASE_FILES} == set(INPUT_TEMPORALITY)
    assert {p.name for p in OVERLAY_FILES} == {"prw-basicauth.yaml", "prw-bearertoken.yaml"}
    for name in ("README.md", "rotel.env"):
        assert (CONFIG_DIR / name).is_file(), name
    # Both overlays are checked merged onto both Prometheus gateways.
    assert len(CONFIGS) == len(BASE_FILES) + 2 * len(OVERLAY_FILES)


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shipped_config(name, check):
    assert CHECKS[check](CONFIGS[name]) == []


def test_configs_are_heavily_commented():
    for path in [*BASE_FILES, *OVERLAY_FILES]:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        comments = sum(line.startswith("#") for line in lines)
        assert comments >= len(lines) // 3, f"{path.name}: {comments} comment lines of {len(lines)}"


def test_gateway_has_the_documented_shape():
    cfg = config("otelcol-gateway.yaml")
    metrics, traces = pipelines(cfg)["metrics"], pipelines(cfg)["traces"]
    assert {component_type(e) for e in metrics["exporters"]} == {
        "prometheusremotewrite", "otlphttp", "debug"}
    assert {component_type(e) for e in traces["exporters"]} == {"otlp", "otlphttp", "debug"}
    assert set(cfg["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    assert any(component_type(p) in {"resource", "resourcedetection", "transform"}
               for p in metrics["processors"])


def test_delta_gateway_converts_before_prometheus():
    metrics = pipelines(config("otelcol-delta.yaml"))["metrics"]
    assert "deltatocumulative" in metrics["processors"]
    assert {"prometheusremotewrite", "prometheus"} <= set(metrics["exporters"])


def test_agent_forwards_to_the_gateway_only():
    cfg = config("otelcol-agent.yaml")
    for pipeline in pipelines(cfg).values():
        assert [component_type(e) for e in pipeline["exporters"]] == ["otlp"]
    grpc = cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert ENV_REF.fullmatch(grpc)["default"].startswith("localhost:")


# --------------------------------------------------------------------------
# Each check catches a broken file


def _set(cfg: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node = cfg
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return cfg


def _pipeline(cfg: dict[str, Any], pipeline_id: str) -> dict[str, list[str]]:
    return cfg["service"]["pipelines"][pipeline_id]


BROKEN: dict[str, tuple[str, str, Callable[[dict[str, Any]], Any]]] = {
    "undefined processor": ("defined", "otelcol-gateway.yaml",
                            lambda c: c["processors"].pop("batch")),
    "undefined exporter in pipeline": ("defined", "otelcol-agent.yaml",
                                       lambda c: _pipeline(c, "traces")["exporters"]
                                       .append("otlp/tempo")),
    "unknown type": ("defined", "otelcol-delta.yaml",
                     lambda c: c["processors"].update(memorylimiter={})),
    "authenticator not started": ("defined",
                                  "otelcol-gateway.yaml+overlays/prw-basicauth.yaml",
                                  lambda c: c["service"].update(extensions=["health_check"])),
    "unused exporter": ("used", "otelcol-gateway.yaml",
                        lambda c: [p["exporters"].remove("debug") for p in pipelines(c).values()]),
    "extension not started": ("used", "otelcol-agent.yaml",
                              lambda c: c["service"].pop("extensions")),
    "memory_limiter not first": ("processor_order", "otelcol-gateway.yaml",
                                 lambda c: _pipeline(c, "metrics")["processors"].reverse()),
    "batch before memory_limiter": ("processor_order", "otelcol-agent.yaml",
                                    lambda c: _pipeline(c, "traces").update(
                                        processors=["batch", "memory_limiter"])),
    "no memory_limiter": ("processor_order", "otelcol-delta.yaml",
                          lambda c: _pipeline(c, "metrics")["processors"]
                          .remove("memory_limiter")),
    "hard-coded remote-write URL": ("no_literals", "otelcol-gateway.yaml",
                                    lambda c: _set(c, "exporters.prometheusremotewrite.endpoint",
                                                   "https://mimir.example.com/api/v1/push")),
    "hard-coded header": ("no_literals", "otelcol-gateway.yaml",
                          lambda c: _set(c, "exporters.otlphttp/vendor.headers.authorization",
                                         "Bearer abc123")),
    "header with a default": ("no_literals", "otelcol-gateway.yaml",
                              lambda c: _set(c, "exporters.otlphttp/vendor.headers.x-api-key",
                                             "${env:VENDOR_KEY:-abc123}")),
    "hard-coded password": ("no_literals", "otelcol-gateway.yaml+overlays/prw-basicauth.yaml",
                            lambda c: _set(c, "extensions.basicauth/prw.client_auth.password",
                                           "hunter2")),
    "host as default": ("no_literals", "otelcol-agent.yaml",
                        lambda c: _set(c, "exporters.otlp/gateway.endpoint",
                                       "${env:OTEL_GATEWAY_ENDPOINT:-gateway.prod:4317}")),
    "bare variable": ("no_literals", "otelcol-delta.yaml",
                      lambda c: _set(c, "exporters.prometheusremotewrite.endpoint",
                                     "${PROMETHEUS_REMOTE_WRITE_URL}")),
    "host in another field": ("no_literals", "otelcol-gateway.yaml",
                              lambda c: _set(c, "processors.resource/environment.attributes",
                                             [{"key": "x", "value": "10.1.2.3",
                                               "action": "insert"}])),
    "delta without deltatocumulative": ("temporality", "otelcol-delta.yaml",
                                        lambda c: _pipeline(c, "metrics")["processors"]
                                        .remove("deltatocumulative")),
    "cumulativetodelta before remote write": ("temporality", "otelcol-gateway.yaml",
                                              lambda c: _pipeline(c, "metrics")["processors"]
                                              .insert(1, "cumulativetodelta")),
    "prometheus on the agent": ("temporality", "otelcol-agent.yaml",
                                lambda c: _pipeline(c, "metrics")["exporters"]
                                .append("prometheus")),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_check_catches(case):
    check, name, mutate = BROKEN[case]
    broken = config(name)
    mutate(broken)
    _, text, temporality = CONFIGS[name]
    assert CHECKS[check]((broken, text, temporality)), f"{check} did not catch: {case}"
    assert CHECKS[check](CONFIGS[name]) == []  # the shipped file, untouched


def test_undocumented_variable_is_caught():
    text = CONFIGS["otelcol-gateway.yaml"][1]
    assert undocumented_variables(text) == []
    broken = text.replace("${env:DEBUG_VERBOSITY:-basic}", "${env:SOME_NEW_SETTING:-basic}")
    assert undocumented_variables(broken) == ["SOME_NEW_SETTING is read but not documented"]


def test_merge_replaces_lists_and_merges_maps():
    merged = merge({"a": {"x": 1, "l": [1, 2]}, "b": 2}, {"a": {"y": 3, "l": [9]}})
    assert merged == {"a": {"x": 1, "y": 3, "l": [9]}, "b": 2}


# --------------------------------------------------------------------------
# rotel.env

ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>.*)")
# NAME=${NAME:-default} or NAME=${NAME:?message}: the environment wins.
SELF_DEFAULT = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:-|:\?)(?P<arg>[^}]*)\}")
ROTEL_SECRETS = ("HEADERS", "API_KEY", "PASSWORD", "TOKEN", "KEY_PEM", "KEY_FILE", "SASL")


def parse_rotel_env(text: str) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """name -> (":-" or ":?", default or message), and the problems."""
    assignments: dict[str, tuple[str, str]] = {}
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = ASSIGNMENT.fullmatch(line)
        if match is None:
            problems.append(f"line {number}: not NAME=value")
            continue
        name, value = match["name"], match["value"]
        if not name.startswith("ROTEL_"):
            problems.append(f"line {number}: {name} is not a rotel variable")
        if name in assignments:
            problems.append(f"line {number}: {name} set twice")
        ref = SELF_DEFAULT.fullmatch(value)
        if ref is None or ref["name"] != name:
            problems.append(f"line {number}: {name} must be ${{{name}:-default}} "
                            "(the environment overrides it)")
            continue
        if ref["op"] == ":-" and not ref["arg"]:
            problems.append(f"line {number}: {name} has an empty default (rotel rejects it)")
        assignments[name] = (ref["op"], ref["arg"])
    return assignments, problems


def rotel_env_problems(text: str) -> list[str]:
    assignments, problems = parse_rotel_env(text)
    if assignments.get("ROTEL_OTLP_EXPORTER_ENDPOINT", ("", ""))[0] != ":?":
        problems.append("ROTEL_OTLP_EXPORTER_ENDPOINT must be required (${VAR:?...})")
    for name, (op, arg) in assignments.items():
        if any(word in name for word in ROTEL_SECRETS):
            problems.append(f"{name}: credentials belong in the environment, not in the file")
        if name == "ROTEL_DAEMON":
            problems.append("ROTEL_DAEMON: rotel must run in the foreground")
        if op == ":-" and "ENDPOINT" in name and not LOCAL_ADDRESS.fullmatch(arg):
            problems.append(f"{name}: default {arg!r} names a host")
        elif op == ":-" and LITERAL_ADDRESS.search(arg) and not LOCAL_ADDRESS.fullmatch(arg):
            problems.append(f"{name}: default {arg!r} names a host")
    return problems


def unaccepted_names(text: str, accepted: frozenset[str]) -> list[str]:
    assignments, _ = parse_rotel_env(text)
    return sorted(name for name in assignments if name not in accepted)


def test_rotel_env_is_consistent():
    assert rotel_env_problems(ROTEL_ENV.read_text()) == []


@pytest.mark.parametrize("line, expected", [
    ("ROTEL_OTLP_EXPORTER_CUSTOM_HEADERS=${ROTEL_OTLP_EXPORTER_CUSTOM_HEADERS:-x=y}",
     "credentials belong in the environment"),
    ("ROTEL_EXPORTER=otlp", "the environment overrides it"),
    ("ROTEL_OTLP_GRPC_ENDPOINT=${ROTEL_OTLP_GRPC_ENDPOINT:-10.0.0.7:4317}", "names a host"),
    ("ROTEL_DEBUG_LOG=${ROTEL_DEBUG_LOG:-}", "empty default"),
    ("ROTEL_DAEMON=${ROTEL_DAEMON:-true}", "foreground"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT=${OTEL_EXPORTER_OTLP_ENDPOINT:-localhost:4317}",
     "not a rotel variable"),
    ("export ROTEL_BATCH_TIMEOUT=1s", "not NAME=value"),
])
def test_rotel_env_check_catches(line, expected):
    broken = ROTEL_ENV.read_text() + line + "\n"
    assert any(expected in problem for problem in rotel_env_problems(broken))


def test_rotel_env_check_catches_default_exporter_host():
    broken = re.sub(r"ROTEL_OTLP_EXPORTER_ENDPOINT:\?[^}]*",
                    "ROTEL_OTLP_EXPORTER_ENDPOINT:-http://gateway.prod:4317",
                    ROTEL_ENV.read_text())
    problems = rotel_env_problems(broken)
    assert any("must be required" in p for p in problems)
    assert any("names a host" in p for p in problems)


def test_rotel_env_names_are_accepted_by_rotel_agent():
    accepted = accepted_variables(require_rotel_agent())
    text = ROTEL_ENV.read_text()
    assert unaccepted_names(text, accepted) == []
    # The check notices a name rotel-agent does not know (a typo, or
    # ROTEL_ENABLED, which only the Python wrapper reads).
    broken = text + "ROTEL_OTLP_EXPORTER_ENDPIONT=${ROTEL_OTLP_EXPORTER_ENDPIONT:-x}\n"
    broken += "ROTEL_ENABLED=${ROTEL_ENABLED:-true}\n"
    assert unaccepted_names(broken, accepted) == ["ROTEL_ENABLED", "ROTEL_OTLP_EXPORTER_ENDPIONT"]


def test_rotel_env_requires_the_exporter_endpoint():
    result = source_env_file(ROTEL_ENV, base_env())
    assert result.returncode != 0
    assert "ROTEL_OTLP_EXPORTER_ENDPOINT" in result.stderr


def test_rotel_env_defaults_and_overrides():
    result = source_env_file(ROTEL_ENV, base_env(
        ROTEL_OTLP_EXPORTER_ENDPOINT="http://127.0.0.1:1", ROTEL_OTLP_GRPC_ENDPOINT="0.0.0.0:5317"))
    assert result.returncode == 0, result.stderr
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert env["ROTEL_OTLP_GRPC_ENDPOINT"] == "0.0.0.0:5317"  # the environment wins
    assert env["ROTEL_OTLP_HTTP_ENDPOINT"] == "localhost:4318"  # the file's default
    assert env["ROTEL_OTLP_EXPORTER_ENDPOINT"] == "http://127.0.0.1:1"
    assert env["ROTEL_EXPORTER"] == "otlp"
    assert "ROTEL_DAEMON" not in env


def _export_one_counter(endpoint: str) -> None:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{endpoint}/v1/metrics"),
                                           export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    provider.get_meter("rotel-check").create_counter("vllm.spec_decode.drafts").add(7)
    provider.shutdown()  # exports once


def test_rotel_agent_runs_the_shipped_config():
    """rotel-agent accepts every value in rotel.env, listens on both OTLP
    ports, forwards OTLP/HTTP input, and stops cleanly on SIGTERM."""
    agent = require_rotel_agent()
    with OtlpReceiver() as receiver:
        rotel = RotelAgent(agent, receiver.endpoint("grpc"))
        with rotel:
            _export_one_counter(rotel.endpoint("http/protobuf"))
            arrived = receiver.store.wait_for(
                lambda: receiver.store.counter_total("vllm.spec_decode.drafts") == 7, 20)
            assert arrived, rotel.log()
        assert rotel.returncode == 0, rotel.log()


def test_rotel_agent_refuses_a_broken_value(tmp_path):
    agent = require_rotel_agent()
    broken = tmp_path / "rotel.env"
    broken.write_text(ROTEL_ENV.read_text().replace(
        "${ROTEL_DEBUG_LOG:-none}", "${ROTEL_DEBUG_LOG:-everything}"))
    rotel = RotelAgent(agent, "http://127.0.0.1:1", env_file=broken)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="everything"):
        rotel.start()
    rotel.stop()
    assert time.monotonic() - start < 20

