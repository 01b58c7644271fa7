"""The scheduler-level tests against other vLLM releases' own schedulers.

Each release in ``vllm_releases.CI_RELEASES`` (the oldest supported, one in
the middle, the newest) is fetched from the package index, unpacked without
its compiled parts, and ``tests/test_accounting.py`` runs in a child pytest
with it ahead of the venv's vLLM (0.32.0, on which the whole suite runs).
The child checks it imported that release (``prepare_release_host``).
``tests/vllm_releases.py`` runs the full matrix.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import vllm_releases


@pytest.fixture(scope="module")
def accounting_tests() -> int:
    """How many tests ``tests/test_accounting.py`` holds (collected here)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         str(vllm_releases.REPO / "tests" / "test_accounting.py")],
        capture_output=True, text=True, cwd=vllm_releases.REPO)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert proc.returncode == 0 and ids, proc.stdout[-2000:] + proc.stderr[-2000:]
    return len(ids)


@pytest.mark.parametrize("version", vllm_releases.CI_RELEASES)
def test_scheduler_level_tests_pass_on_release(version, accounting_tests):
    result = vllm_releases.run_scheduler_tests(version)
    assert result.ok, result.notes
    # Every test ran there or was skipped for what the release lacks, and
    # most ran: the accounting tests were exercised, not just skipped.
    assert result.passed + result.skipped == accounting_tests, result
    assert result.passed > accounting_tests // 2, result
