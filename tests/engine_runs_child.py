"""Several offline ``LLM`` runs in one process, each with its own environment.

``python tests/engine_runs_child.py '<json plan>'``: for each entry of
``plan["runs"]``, set its ``env`` in ``os.environ`` (which a new engine-core
process inherits, and which the plugin reads when a new engine starts),
then build an ``LLM``, generate, and ``del`` it, as
``otel_specdec._engine_run.run`` does. One result line per run on stdout;
a ``=== run <label>`` line on stderr before each, so that the log can be
split by run. Starting vLLM once for several runs keeps the failure
matrix affordable.
"""

from __future__ import annotations

import json
import os
import sys

from otel_specdec._engine_run import RESULT_PREFIX, run

RUN_MARK = "=== run "


def main() -> None:
    plan = json.loads(sys.argv[1])
    for step in plan["runs"]:
        os.environ.update(step["env"])
        print(RUN_MARK + step["label"], file=sys.stderr, flush=True)
        result = run(plan["config"])
        result["label"] = step["label"]
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    print(RUN_MARK + "end", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
