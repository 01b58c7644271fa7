"""Every environment variable the plugin reads is named in
``otel_specdec.environment_variables`` and nowhere else in the package, and
the plugin's own are documented in docs/configuration.md."""

from __future__ import annotations

import ast
from pathlib import Path

from otel_specdec import environment_variables as env_vars

PACKAGE = Path(__file__).resolve().parent.parent / "otel_specdec"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_no_module_names_a_variable_itself():
    found = []
    for path in PACKAGE.glob("*.py"):  # the engine side; the demo sets variables
        if path.name == "environment_variables.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.startswith(("OTEL_", "VLLM_"))):
                found.append(f"{path.name}:{node.lineno}: {node.value}")
    assert not found, found


def test_the_plugins_own_variables_are_documented():
    text = DOCS.read_text()
    for name in (env_vars.OTEL_SPECDEC_ENABLED, env_vars.OTEL_SPECDEC_TRACES,
                 env_vars.OTEL_SPECDEC_SHUTDOWN_TIMEOUT):
        assert f"`{name}`" in text, name
