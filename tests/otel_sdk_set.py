"""OpenTelemetry requirement sets: install one beside the venv, run the tests on it.

Like the contrib instrumentations' "oldest" and "latest" test environments,
``tests/requirements/<name>-otel.txt`` lists the OpenTelemetry packages
(and the few others whose accepted range they narrow) of one set:
``oldest`` is the declared minimum of ``pyproject.toml``, ``latest`` the
newest releases. A set is installed with ``pip install --no-deps --target``
into its own folder, which is then put ahead of the venv on ``PYTHONPATH``:
``import opentelemetry.sdk`` then imports that set's SDK, and everything
else (vLLM, pytest) is the venv's.

Usage::

    .venv/bin/python tests/otel_sdk_set.py oldest --run-tests    # the non-engine suite
    .venv/bin/python tests/otel_sdk_set.py oldest --run-tests -- tests/test_failures.py
    .venv/bin/python tests/otel_sdk_set.py latest                # install only

A set is installed under ``.otel-sets/<name>`` and installed again only when
its requirements file changed (or with ``--refresh``, which ``latest``
needs to pick up new releases).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "tests" / "requirements"
SETS_ROOT = REPO / ".otel-sets"
SET_NAMES = ("oldest", "latest")
# The non-engine suite: what ``--run-tests`` runs when given no pytest arguments.
DEFAULT_PYTEST_ARGS = ("-m", "not engine")

# Set in a child that runs on a set: the folder of that set.
CHILD_ENV = "OTEL_SPECDEC_SDK_SET"
# In the cache marker: the requirements the folder was installed from.
_MARKER = ".complete"


def requirements_file(name: str) -> Path:
    if name not in SET_NAMES:
        raise ValueError(f"unknown set {name!r}: expected one of {', '.join(SET_NAMES)}")
    return REQUIREMENTS / f"{name}-otel.txt"


def requirements(name: str) -> list[str]:
    """The set's requirement lines, without comments and blank lines."""
    lines = []
    for line in requirements_file(name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            lines.append(line)
    return lines


def pinned(name: str, package: str) -> str | None:
    """The version ``==``-pinned for ``package`` in set ``name``, if any."""
    for line in requirements(name):
        project, sep, version = line.partition("==")
        if sep and project.strip().lower() == package.lower():
            return version.strip()
    return None


def _fingerprint(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def install_set(name: str, dest: Path, refresh: bool = False) -> Path:
    """Install set ``name`` into ``dest`` (skipped when ``dest`` already holds
    exactly these requirements); returns ``dest``."""
    lines = requirements(name)
    key = _fingerprint(lines)
    marker = dest / _MARKER
    if not refresh and marker.exists() and marker.read_text().strip() == key:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Installed beside the destination, then renamed: an interrupted install
    # never leaves a folder that looks complete.
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-") as tmp:
        staging = Path(tmp) / "set"
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "--no-deps", "--no-compile", "--target", str(staging), *lines],
            capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"pip install of the {name} OpenTelemetry set failed:\n{result.stderr[-3000:]}"
            )
        (staging / _MARKER).write_text(key + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
    return dest


def child_env(set_dir: Path) -> dict[str, str]:
    """Environment for a child process that uses the set in ``set_dir``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(set_dir), str(REPO), env.get("PYTHONPATH")) if p
    )
    env.setdefault("OTEL_METRICS_EXPORTER", "none")
    # The child's own set tests must not start another child.
    env[CHILD_ENV] = str(set_dir)
    return env


# Run in the child: reports the SDK that the tests really import, then runs pytest.
_CHILD = (
    "import sys, pytest, opentelemetry.sdk.version as v; "
    "print('otel-sdk-set: opentelemetry-sdk', v.__version__, 'from', v.__file__, flush=True); "
    "sys.exit(pytest.main(sys.argv[1:]))"
)


def run_tests(set_dir: Path, pytest_args: list[str] | tuple[str, ...] = DEFAULT_PYTEST_ARGS,
              capture: bool = False) -> subprocess.CompletedProcess[str]:
    """Run pytest with ``pytest_args`` in a child that imports the set's SDK.

    Its first output line names the SDK version and where it came from.
    """
    cmd = [sys.executable, "-c", _CHILD, "-q", "-p", "no:cacheprovider", *pytest_args]
    return subprocess.run(cmd, env=child_env(set_dir), cwd=REPO, text=True,
                          capture_output=capture)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Arguments after -- are passed to pytest.")
    parser.add_argument("name", choices=SET_NAMES)
    parser.add_argument("--dest", type=Path, help="install folder (default .otel-sets/NAME)")
    parser.add_argument("--refresh", action="store_true", help="install again even if cached")
    parser.add_argument("--run-tests", action="store_true",
                        help="run pytest with the set (default: the non-engine suite)")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" goes to pytest untouched (options included).
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    dest = install_set(args.name, args.dest or SETS_ROOT / args.name, refresh=args.refresh)
    print(f"otel-sdk-set: {args.name} set in {dest}", flush=True)
    if not args.run_tests:
        return 0
    return run_tests(dest, pytest_args or DEFAULT_PYTEST_ARGS).returncode


if __name__ == "__main__":
    sys.exit(main())
