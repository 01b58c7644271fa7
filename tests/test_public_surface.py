"""Each module's ``__all__`` names what other modules of the package import
from it: a reader can trust it as the module's interface."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "otel_specdec"


def imported_names() -> dict[str, set[str]]:
    """module -> names other package modules take from it, by
    ``from otel_specdec.M import X`` or ``M.X`` after ``from otel_specdec import M``."""
    used: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("otel_specdec."):
                    target = node.module.split(".", 1)[1]
                    if target != path.stem:
                        used.setdefault(target, set()).update(a.name for a in node.names)
                elif node.module == "otel_specdec":
                    for a in node.names:
                        aliases[a.asname or a.name] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id] != path.stem):
                used.setdefault(aliases[node.value.id], set()).add(node.attr)
    return used


def declared(module: str) -> list[str] | None:
    path = PACKAGE / f"{module.replace('.', '/')}.py"
    if not path.exists():
        return None
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
            return list(ast.literal_eval(node.value))
    return None


# Modules of constants only, all of them public (the metric contract, and
# the instrumentation's package.py and version.py by contrib's convention).
CONSTANT_MODULES = {"_instruments", "package", "version"}


@pytest.mark.parametrize("module", sorted(
    m for m in imported_names()
    if m not in CONSTANT_MODULES and (PACKAGE / f"{m.replace('.', '/')}.py").exists()
))
def test_all_names_what_the_package_imports(module):
    names = declared(module)
    assert names is not None, f"{module} has no __all__"
    missing = sorted(imported_names().get(module, set()) - set(names))
    assert not missing, f"{module}.__all__ lacks {missing}"
