"""Test-only start-up of every Python process of an engine child.

A test puts this folder on the child's ``PYTHONPATH``; Python then runs it
at start-up in the child and in every process vLLM starts from it (engine
core, workers), which no test code reaches otherwise. It acts only on
these variables:

* ``SPECDEC_TEST_TIMED_LOG=1``: the plugin's log, DEBUG included, goes to
  stderr with wall-clock time (ms) and pid on each line: when its final
  export began and ended, and with what result (the evidence of an
  engine child's shutdown; vLLM's own lines carry seconds only).
* ``SPECDEC_TEST_EXPORT_DELAY_S=<s>``: an engine that stops waits ``s``
  seconds before its final metrics export, as an engine process whose
  main thread is busy when SIGTERM comes reaches it late.
"""

from __future__ import annotations

import logging
import os
import sys
import time

if os.environ.get("SPECDEC_TEST_TIMED_LOG") == "1":
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter(
        "%(asctime)s.%(msecs)03d pid=%(process)d %(levelname)s %(message)s", "%H:%M:%S"))
    _plugin_logger = logging.getLogger("otel_specdec")
    _plugin_logger.addHandler(_handler)
    _plugin_logger.setLevel(logging.DEBUG)

_delay_s = float(os.environ.get("SPECDEC_TEST_EXPORT_DELAY_S") or 0)
if _delay_s > 0:
    import wrapt

    def _late(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
        logging.getLogger("otel_specdec.test").warning(
            "otel_specdec test: final export delayed by %g s", _delay_s)
        time.sleep(_delay_s)
        return wrapped(*args, **kwargs)

    def _delay_final_export(module):  # type: ignore[no-untyped-def]
        wrapt.wrap_function_wrapper(module, "Runtime.engine_stopped", _late)

    wrapt.register_post_import_hook(_delay_final_export, "otel_specdec._runtime")
