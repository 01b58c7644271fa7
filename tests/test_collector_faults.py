"""A collector that hangs, refuses, throttles or resets never holds vLLM.

On the real engine (CPU build, tiny model, ngram k=3) with the collectors of
``faulty_collectors``: every shutdown path ends within vLLM's own shutdown
time plus the plugin's shutdown budget, with the outputs unchanged; while
serving, a hanging collector costs the engine nothing and, when it comes
back, gets the exact totals.

Every run sets ``OTEL_EXPORTER_OTLP_TIMEOUT=10000``: the specification's
default written in its unit (milliseconds), which the Python SDK would read
as 10000 seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from engine_child import RESULT_PREFIX
from engine_runs_child import RUN_MARK
from fault_helpers import ApiServer, EngineChild, clean_env, drain_lines
from faulty_collectors import KINDS, FaultyCollector, RecoveringCollector

from otel_specdec._settings import DEFAULT_SHUTDOWN_TIMEOUT_S, SHUTDOWN_TIMEOUT_ENV
from otel_specdec.demo.receiver import OtlpReceiver

pytestmark = pytest.mark.engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
PROTOCOLS = ("grpc", "http/protobuf")
MS_TIMEOUT = "10000"
UNIT_WARNING = "can only be meant as milliseconds"
CUT_WARNING = "were not delivered"
# What a loaded CI machine may add to any bound below.
SLACK_S = 4.0
# The front end's margin for engine teardown (otel_specdec._shutdown_grace).
TEARDOWN_MARGIN_S = 5.0


def _fault_env(endpoint: str, protocol: str, **extra: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_TIMEOUT": MS_TIMEOUT, "OTEL_METRIC_EXPORT_INTERVAL": "1000",
            **extra}


def _split_log(log: str) -> dict[str, str]:
    """The child's log by run label (engine processes write to it too)."""
    sections: dict[str, str] = {}
    label = None
    for line in log.splitlines(keepends=True):
        if line.startswith(RUN_MARK):
            label = line[len(RUN_MARK):].strip()
            sections[label] = ""
        elif label is not None:
            sections[label] += line
    return sections


def _run_offline(model: str, runs: list[dict], env: dict[str, str]) -> tuple[dict, dict, float]:
    """The runs in one child; results and log sections by label, and the
    seconds from the last result to the child's exit. Each result gets the
    child's vLLM ``[shutdown]`` lines (vLLM logs to stdout) as
    ``shutdown_log``, each with the seconds since the run began, and last
    the result's."""
    plan = {"config": {"model": model, "speculative_config": NGRAM, "max_tokens": 48},
            "runs": runs}
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("engine_runs_child.py")), json.dumps(plan)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr = drain_lines(proc.stderr)
    results: dict[str, dict] = {}
    shutdown_log: list[tuple[float, str]] = []
    assert proc.stdout is not None
    try:
        began = time.monotonic()
        for line in proc.stdout:
            if "[shutdown]" in line:
                shutdown_log.append((time.monotonic() - began, line.strip()))
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX):])
                shutdown_log.append((time.monotonic() - began, "result"))
                result["shutdown_log"], shutdown_log = shutdown_log, []
                results[result["label"]] = result
                last = began = time.monotonic()
                if len(results) == len(runs):
                    break
        assert len(results) == len(runs), "".join(stderr)[-6000:]
        proc.wait(timeout=120)
        exit_seconds = time.monotonic() - last
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(stderr)[-6000:]
    return results, _split_log("".join(stderr)), exit_seconds


def _worker_exit_seconds(shutdown_log: list[tuple[float, str]]) -> float:
    """How long vLLM's executor waited for its workers to exit: its own
    teardown, after the plugin's export (its worker grace, then SIGTERM and
    up to 4 s more); 0 where the log does not say. Where the workers got
    SIGTERM and their exit is not logged, until the run's result."""
    waits = [t for t, line in shutdown_log if "Executor: waiting for worker exit" in line]
    if not waits:
        return 0.0
    for t, line in shutdown_log:
        if t >= waits[0] and ("exited gracefully" in line or "sending SIGKILL" in line):
            return t - waits[0]
    return shutdown_log[-1][0] - waits[0]


# The faults the offline matrices run: every kind over both transports in
# the engine's own process; in an engine-core process of its own (each run
# an engine start, about half a minute), the reported case (hang) over both
# and the other kinds once each, the transports alternating, so that CI
# stays under 45 minutes. The exporter's side of every fault is the same
# code in both.
EVERY_FAULT = [(kind, protocol) for kind in KINDS for protocol in PROTOCOLS]
OWN_PROCESS_FAULTS = [("hang", PROTOCOLS[0]), ("hang", PROTOCOLS[1]),
                      *[(kind, PROTOCOLS[i % 2]) for i, kind in enumerate(KINDS[1:], 1)]]


def _offline_matrix(model: str, multiprocessing: str, budget_s: float) -> None:
    faults = OWN_PROCESS_FAULTS if multiprocessing == "1" else EVERY_FAULT
    collectors = [FaultyCollector(kind, protocol) for kind, protocol in faults]
    env = clean_env(VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing)
    if budget_s != DEFAULT_SHUTDOWN_TIMEOUT_S:
        env[SHUTDOWN_TIMEOUT_ENV] = str(budget_s)
    with OtlpReceiver() as receiver:
        for c in collectors:
            c.__enter__()
        try:
            runs = [{"label": "healthy", "env": _fault_env(receiver.endpoint("grpc"), "grpc")}]
            runs += [{"label": repr(c), "env": _fault_env(c.endpoint, c.protocol)}
                     for c in collectors]
            results, logs, exit_seconds = _run_offline(model, runs, env)
            contacts = {repr(c): c.contacts for c in collectors}
        finally:
            for c in collectors:
                c.__exit__(None, None, None)
        healthy = results.pop("healthy")
        # The healthy run's totals arrived: the setup exports at all.
        assert receiver.store.spec_decode_totals() == healthy["vllm"]
    # The whole process, abandoned export threads and all, exits promptly.
    assert exit_seconds < SLACK_S + 5, exit_seconds
    unit_warnings = sum(log.count(UNIT_WARNING) for log in logs.values())
    # Once per process that reads the timeout: each engine-core process, or
    # the one process when the engine runs in it.
    assert unit_warnings == (len(runs) if multiprocessing == "1" else 1), unit_warnings
    for label, result in results.items():
        assert contacts[label] > 0, (label, "the exporter never reached the collector")
        assert result["token_ids"] == healthy["token_ids"], label
        assert result["vllm"] == healthy["vllm"], label
        # Generation does not wait for the collector: a blocked step would
        # cost an export timeout per step.
        rate = [r["output_tokens"][0] / r["gen_seconds"][0] for r in (healthy, result)]
        assert rate[1] >= 0.4 * rate[0], (label, rate)
        # What the fault added to the shutdown, less any difference in how
        # long vLLM's own workers took to exit (its executor teardown, after
        # the plugin's export). On a loaded machine a worker can outlive
        # vLLM's 5 s worker grace in any run, healthy or not: reproduced
        # with two CPU hogs, and a CI run measured a 10.6 s difference.
        delay = (result["shutdown_seconds"] - healthy["shutdown_seconds"]
                 - (_worker_exit_seconds(result["shutdown_log"])
                    - _worker_exit_seconds(healthy["shutdown_log"])))
        assert delay <= budget_s + SLACK_S, (label, result["shutdown_seconds"],
                                             healthy["shutdown_seconds"],
                                             result["shutdown_log"], healthy["shutdown_log"])
        # The final export never reaches the collector: one line says so.
        assert logs[label].count(CUT_WARNING) == 1, (label, logs[label][-3000:])
    assert CUT_WARNING not in logs["healthy"]


def test_offline_engine_in_own_process_each_fault(tiny_model):
    """``LLM`` with its engine core in a process of its own, ``del llm``: the
    reported case (10000, hanging collector) over gRPC and HTTP and every
    other fault (``OWN_PROCESS_FAULTS``); a 4 s budget."""
    _offline_matrix(tiny_model, "1", 4.0)


def test_offline_engine_in_process_every_fault(tiny_model):
    """The engine in the ``LLM``'s own process, every fault over gRPC and
    HTTP; a 3 s budget."""
    _offline_matrix(tiny_model, "0", 3.0)


# The OpenAI server, stopped by SIGTERM as an orchestrator stops it. Each
# kind with one engine, the transports alternating; with two engines (the
# same shutdown path, once per engine process) the collector that hangs,
# the longest wait: each server case takes a minute or more (two engines,
# nearly two), and CI must stay under 45 minutes.
SERVER_CASES = [
    *[(kind, PROTOCOLS[i % 2], 1) for i, kind in enumerate(KINDS)],
    ("hang", PROTOCOLS[1], 2),
]
SERVER_BUDGET_S = 3.0
SERVER_PROMPTS = ("one two three one two three one two", "the lazy dog the lazy dog")


def _serve_and_stop(model: str, env: dict[str, str], data_parallel: int) -> tuple[list, float, str]:
    extra = ("--data-parallel-size", str(data_parallel)) if data_parallel > 1 else ()
    server = ApiServer(model, NGRAM, env, *extra)
    try:
        server.wait_healthy()
        with ThreadPoolExecutor(2) as pool:
            texts = [c["choices"][0]["text"] for c in pool.map(server.complete, SERVER_PROMPTS)]
        # The server and every process it started (engines, DP coordinator).
        family = [psutil.Process(server.proc.pid),
                  *psutil.Process(server.proc.pid).children(recursive=True)]
        stopped = time.monotonic()
        server.terminate(timeout=120)
        _, alive = psutil.wait_procs(family, timeout=120)
        stop_seconds = time.monotonic() - stopped
        assert not alive, alive
        time.sleep(0.5)  # the last lines of the log, through the pipe
    finally:
        server.kill()
    return texts, stop_seconds, server.log_tail(200_000)


@pytest.fixture(scope="module")
def healthy_server(tiny_model) -> dict:
    """vLLM's own stop time and outputs, with a collector that works."""
    with OtlpReceiver() as receiver:
        env = clean_env(**_fault_env(receiver.endpoint("grpc"), "grpc"),
                        **{SHUTDOWN_TIMEOUT_ENV: str(SERVER_BUDGET_S)})
        texts, seconds, _ = _serve_and_stop(tiny_model, env, 1)
    return {"texts": texts, "stop_seconds": seconds}


@pytest.mark.parametrize(("kind", "protocol", "data_parallel"), SERVER_CASES,
                         ids=[f"{k}-{p}-dp{d}" for k, p, d in SERVER_CASES])
def test_api_server_sigterm_with_faulty_collector(tiny_model, healthy_server, kind, protocol,
                                                  data_parallel):
    with FaultyCollector(kind, protocol) as collector:
        env = clean_env(**_fault_env(collector.endpoint, protocol),
                        **{SHUTDOWN_TIMEOUT_ENV: str(SERVER_BUDGET_S)})
        texts, seconds, log = _serve_and_stop(tiny_model, env, data_parallel)
        assert collector.contacts > 0
    assert texts == healthy_server["texts"]
    # Until the last engine process is gone: vLLM's own time plus the budget.
    assert seconds <= healthy_server["stop_seconds"] + SERVER_BUDGET_S + SLACK_S, (
        seconds, healthy_server["stop_seconds"], log[-4000:])
    assert log.count(UNIT_WARNING) == data_parallel, log[-4000:]
    # At most one line per engine. An engine logs it when its budget runs
    # out; one that vLLM's process manager has already SIGKILLed (its grace
    # is the budget plus a teardown margin, which a loaded machine can
    # overrun) cannot. Seen over gRPC with two engines, and once with one on
    # a loaded machine; the bound above held each time. The offline
    # matrices assert the line exactly.
    assert log.count(CUT_WARNING) <= data_parallel, log[-4000:]


def _engine_core(parent_pid: int) -> psutil.Process:
    children = psutil.Process(parent_pid).children(recursive=True)
    cores = [p for p in children if "EngineCore" in " ".join([p.name(), *p.cmdline()])]
    return cores[0] if cores else max(children, key=lambda p: p.memory_info().rss)


def _held(process: psutil.Process) -> tuple[int, int, int]:
    return process.num_threads(), process.num_fds(), process.memory_info().rss


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_hanging_collector_costs_nothing_and_gets_exact_totals_back(tiny_model, protocol):
    """Serving while the collector hangs for many intervals: exports do not
    pile up (one connection at a time, threads, descriptors and memory
    flat); when it answers again, the next export carries vLLM's totals."""
    with OtlpReceiver() as receiver:
        target = receiver.grpc_port if protocol == "grpc" else receiver.http_port
        proxy = RecoveringCollector(target).start()
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{proxy.port}",
                        OTEL_EXPORTER_OTLP_PROTOCOL=protocol, OTEL_EXPORTER_OTLP_TIMEOUT="1",
                        OTEL_METRIC_EXPORT_INTERVAL="300")
        child = EngineChild({"model": tiny_model, "speculative_config": NGRAM, "phases": 2,
                             "max_tokens": 32}, env)
        try:
            counted = child.wait_pause()
            core = _engine_core(child.proc.pid)
            time.sleep(3)  # settle into the hanging rhythm
            before, contacts = _held(core), proxy.connections
            time.sleep(12)  # about ten more export attempts, all hanging
            after = _held(core)
            if protocol != "grpc":  # gRPC waits on its one connection
                assert proxy.connections > contacts, "the exporter stopped trying"
            assert proxy.max_open_while_hanging <= 2, proxy.max_open_while_hanging
            assert after[0] <= before[0] + 1 and after[1] <= before[1] + 2, (before, after)
            assert after[2] - before[2] < 32 * 2**20, (before, after)
            assert receiver.store.spec_decode_totals()["drafts"] == 0
            proxy.recover()
            reached = receiver.store.wait_for(
                lambda: receiver.store.spec_decode_totals() == counted, 60)
            assert reached, (receiver.store.spec_decode_totals(), counted)
            child.proceed()
            result = child.result()
        finally:
            child.kill()
            proxy.stop()
        assert receiver.store.spec_decode_totals() == result["vllm"]
