"""Benchmarks, run from the repository root as modules::

    .venv/bin/python -m bench.step_cost
    .venv/bin/python -m bench.memory

They import the installed package, the scheduler harness the tests use
(``tests/scheduler_harness.py``) and their own helpers (``bench._common``)
as modules of the repository, with no ``sys.path`` edits.
"""
