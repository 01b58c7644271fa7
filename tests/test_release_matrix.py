"""The scheduler-level tests against other vLLM releases' own schedulers.

Each release in ``vllm_releases.CI_RELEASES`` (the oldest supported, one in
the middle, the newest) is fetched from the package index, unpacked without
its compiled parts, and ``tests/test_accounting.py`` runs in a child pytest
with it ahead of the venv's vLLM (0.32.0, on which the whole suite runs).
The child checks it imported that release (``prepare_release_host``).
``tests/vllm_releases.py`` runs the full matrix.
"""

from __future__ import annotations

import pytest
import vllm_releases


@pytest.mark.parametrize("version", vllm_releases.CI_RELEASES)
def test_scheduler_level_tests_pass_on_release(version):
    result = vllm_releases.run_scheduler_tests(version)
    assert result.ok, result.notes
    assert result.passed >= 40, result  # the accounting tests ran, not just skipped
