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
* ``SPECDEC_TEST_STACKS_BEFORE_KILL=1``: every process dumps its threads'
  stacks (``faulthandler``, to stderr) on SIGUSR2, and vLLM's process
  manager, before it SIGKILLs an engine process tree that outlived its
  shutdown timeout, sends that signal to each process of the tree and
  gives them a second to write: where an engine was stuck (issue 30).
* ``SPECDEC_TEST_SIGTERM_TO_THREAD=1``: the SIGTERM that stops an engine
  process is sent to one of its threads other than the main one
  (``tgkill``), as the kernel may hand a process-wide signal to any thread
  that does not block it (issue 30's cause, made certain).
* ``SPECDEC_TEST_REPORT_PATHS=1``: an engine that stops logs, before its
  final export, which accounting path took its steps and where its C pass
  was loaded from (``specdec-test: accounting paths {json}``).
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
            "specdec-test: final export delayed by %g s", _delay_s)
        time.sleep(_delay_s)
        return wrapped(*args, **kwargs)

    def _delay_final_export(module):  # type: ignore[no-untyped-def]
        wrapt.wrap_function_wrapper(module, "Runtime.engine_stopped", _late)

    wrapt.register_post_import_hook(_delay_final_export, "otel_specdec._runtime")

if os.environ.get("SPECDEC_TEST_REPORT_PATHS") == "1":
    import json

    import wrapt

    _accountants: list = []

    def _keep(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
        accountant = wrapped(*args, **kwargs)
        _accountants.append(accountant)
        return accountant

    def _report(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
        steps: dict = {}
        for accountant in _accountants:
            for path, count in accountant.steps_by_path().items():
                steps[path] = steps.get(path, 0) + count
        scanner = sys.modules.get("otel_specdec._rowscan")
        logging.getLogger("otel_specdec.test").warning(
            "specdec-test: accounting paths %s", json.dumps(
                {"steps": steps, "c_pass": getattr(scanner, "__file__", None)}))
        return wrapped(*args, **kwargs)

    def _report_paths(module):  # type: ignore[no-untyped-def]
        wrapt.wrap_function_wrapper(module, "Runtime.accountant_for", _keep)
        wrapt.wrap_function_wrapper(module, "Runtime.engine_stopped", _report)

    wrapt.register_post_import_hook(_report_paths, "otel_specdec._runtime")

if os.environ.get("SPECDEC_TEST_STACKS_BEFORE_KILL") == "1":
    import faulthandler
    import signal

    import wrapt

    faulthandler.register(signal.SIGUSR2, all_threads=True)

    def _log_signal_state(pid):  # type: ignore[no-untyped-def]
        """Each thread's pending and blocked signals (/proc): who could take SIGTERM."""
        rows = []
        for task in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            try:
                with open(f"/proc/{pid}/task/{task}/status") as status:
                    fields = dict(line.split(":", 1) for line in status if ":" in line)
            except OSError:
                continue
            rows.append(f"{task}{'*' if task == str(pid) else ''} "
                        f"{fields['Name'].strip()} pnd={fields['SigPnd'].strip()} "
                        f"blk={fields['SigBlk'].strip()} state={fields['State'].strip()}")
        logging.getLogger("otel_specdec.test").warning(
            "specdec-test: signals of pid %d: shared pending %s; %s", pid,
            fields.get("ShdPnd", "?").strip() if rows else "?", " | ".join(rows))

    def _stacks_first(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
        try:
            import psutil

            root = psutil.Process(args[0])
            tree = [root, *root.children(recursive=True)]
            logging.getLogger("otel_specdec.test").warning(
                "specdec-test: stacks of %s before SIGKILL",
                ", ".join(f"{p.name()} pid {p.pid}" for p in tree))
            for process in tree:
                _log_signal_state(process.pid)
                os.kill(process.pid, signal.SIGUSR2)
            time.sleep(1.0)
        except Exception:
            logging.getLogger("otel_specdec.test").exception("specdec-test: no stacks")
        return wrapped(*args, **kwargs)

    def _dump_before_kill(module):  # type: ignore[no-untyped-def]
        wrapt.wrap_function_wrapper(module, "kill_process_tree", _stacks_first)

    # vllm.v1.utils.shutdown calls the name it imported.
    wrapt.register_post_import_hook(_dump_before_kill, "vllm.v1.utils")

if os.environ.get("SPECDEC_TEST_SIGTERM_TO_THREAD") == "1":
    import ctypes
    import platform
    import signal
    from multiprocessing import popen_fork

    _TGKILL = {"x86_64": 234, "aarch64": 131}[platform.machine()]
    _SIGTERM_BIT = 1 << (signal.SIGTERM - 1)

    def _other_thread(pid):  # type: ignore[no-untyped-def]
        """A thread of ``pid``, not its main one, that does not block SIGTERM."""
        for task in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            if task == str(pid):
                continue
            with open(f"/proc/{pid}/task/{task}/status") as status:
                blocked = next(int(line.split()[1], 16) for line in status
                               if line.startswith("SigBlk:"))
            if not blocked & _SIGTERM_BIT:
                return int(task)
        raise RuntimeError(f"no thread of {pid} takes SIGTERM")

    _send_signal = popen_fork.Popen._send_signal

    def _to_other_thread(self, sig):  # type: ignore[no-untyped-def]
        if sig != signal.SIGTERM or self.returncode is not None:
            return _send_signal(self, sig)
        tid = _other_thread(self.pid)
        logging.getLogger("otel_specdec.test").warning(
            "specdec-test: SIGTERM to thread %d of pid %d", tid, self.pid)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(_TGKILL, self.pid, tid, int(sig)) != 0:
            raise OSError(ctypes.get_errno(), "tgkill")
        return None

    popen_fork.Popen._send_signal = _to_other_thread
