"""The busy-loop wake-up (``otel_specdec._signal_wake``) without vLLM, each
case in a fresh interpreter (signal handlers and the wakeup fd are
process-wide): a stand-in busy loop idles in ``queue.get()`` in the main
thread, as vLLM's does, and a SIGTERM is sent to another of its threads
(``pthread_kill``), as the kernel may hand it. The engine-level proof, with
vLLM's own loop and handler, is in ``test_final_export``."""

from __future__ import annotations

import json
import subprocess
import sys

# The stand-in engine: vLLM's handler (sets a flag), vLLM's busy loop (sleeps
# in input_queue.get() until an item comes), our wrapper around it.
CHILD = r"""
import json, queue, signal, sys, threading, time
from otel_specdec import _signal_wake, _vllm_compat

_vllm_compat.engine_wakeup_request = lambda: ("WAKEUP", None)
case = sys.argv[1]
handled = []
signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(time.monotonic()))

class Engine:
    input_queue = queue.Queue()
    def run_busy_loop(self):
        while not handled:  # vLLM: one item, then the loop checks its state
            if self.input_queue.get() == "deadline":
                break

helper = threading.Thread(target=time.sleep, args=(30,), daemon=True)
helper.start()
if case == "foreign_fd":
    import os
    theirs = os.pipe()[1]
    os.set_blocking(theirs, False)
    signal.set_wakeup_fd(theirs)

def sigterm_to_helper():
    time.sleep(0.3)
    sent.append(time.monotonic())
    signal.pthread_kill(helper.ident, signal.SIGTERM)

sent = []
threading.Thread(target=sigterm_to_helper, daemon=True).start()
# Ends the loop anyway after 3 s, as the front end's SIGKILL would.
threading.Timer(3.0, lambda: Engine.input_queue.put("deadline")).start()
engine = Engine()
if case == "other_thread":
    out = []
    t = threading.Thread(target=lambda: out.append(
        _signal_wake._busy_loop_wrapper(engine.run_busy_loop, engine, (), {})))
    t.start(); t.join()
else:
    _signal_wake._busy_loop_wrapper(engine.run_busy_loop, engine, (), {})
def ours():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("otel"))

deadline = time.monotonic() + 2  # the reader ends at EOF, once the loop is over
while ours() and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({
    "woken_after_s": handled[0] - sent[0] if handled and sent else None,
    "wakeup_fd_after": signal.set_wakeup_fd(-1),
    "threads": ours(),
}))
"""


def run_case(case: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_sigterm_taken_by_another_thread_wakes_the_idle_loop():
    result = run_case("main")
    # The handler ran as soon as the signal came, not at the 3 s deadline.
    assert result["woken_after_s"] is not None and result["woken_after_s"] < 1.0, result
    # The wakeup fd is unset again and its reader gone once the loop ends.
    assert result["wakeup_fd_after"] == -1
    assert result["threads"] == []


def test_without_the_wake_up_the_loop_sleeps_until_something_else_comes():
    """The failure the wrapper prevents: the same loop, not wrapped, from a
    thread other than the main one (where nothing is installed)."""
    result = run_case("other_thread")
    assert result["woken_after_s"] is not None and result["woken_after_s"] > 2.0, result


def test_a_wakeup_fd_set_by_someone_else_is_left_alone():
    result = run_case("foreign_fd")
    assert result["wakeup_fd_after"] not in (-1, None)
    assert result["threads"] == []
