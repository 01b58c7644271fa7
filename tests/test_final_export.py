"""An offline run's counts reach the collector, or a line says they did not.

An offline job (``LLM.generate`` in a script) with the default 60 s export
interval sends its metrics only in the final export, when the engine stops:
that export is the whole job's record.

* Soak: many short offline runs in a row, the default interval, the
  transports alternating; every run's received totals equal vLLM's
  counters.
* The cause of the losses seen (issue 30): the SIGTERM that stops the
  engine-core process taken by one of its threads other than the main one,
  which then sleeps on in ``input_queue.get()`` with vLLM's handler unrun
  until it is killed (injected here by ``child_site``'s
  ``SPECDEC_TEST_SIGTERM_TO_THREAD``; the plugin's busy-loop wake-up makes
  the engine stop as intended).
* The ordering that loses the record: the engine-core process reaches its
  final export only after vLLM's process manager has stopped waiting for it
  and killed it (its main thread busy when SIGTERM came; injected here by
  ``child_site``'s ``SPECDEC_TEST_EXPORT_DELAY_S``). The process is gone,
  so it cannot say so itself; the process that killed it must, once.
"""

from __future__ import annotations

import pytest
from engine_child import assert_delivered, run_in_child, shutdown_evidence, with_child_site
from engine_runs_child import run_plan_in_child
from fault_helpers import clean_env

from otel_specdec._settings import SHUTDOWN_TIMEOUT_ENV
from otel_specdec._shutdown_grace import _TEARDOWN_MARGIN_S, _VLLM_DEFAULT_GRACE_S
from otel_specdec.demo.receiver import OtlpReceiver

pytestmark = pytest.mark.engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
PROTOCOLS = ("grpc", "http/protobuf")
SOAK_RUNS = 30
# The resource attribute that tells the soak's runs apart at the receiver.
RUN_ATTR = "specdec.test.run"
LOST_WARNING = "ended before its final metrics export had finished"


def test_consecutive_short_offline_runs_each_deliver_vllm_totals(tiny_model):
    """30 short runs, one after another in one process (each its own engine,
    built, generating and stopped with ``del llm``), default interval, gRPC
    and HTTP alternating: every run's totals arrive and equal vLLM's. The
    engines run in the process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): an
    engine-core process of its own costs half a minute of start-up per run;
    that path's final export is what the engine tests and the test below
    check."""
    with OtlpReceiver() as receiver:
        runs = [{"label": str(i), "env": {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint(PROTOCOLS[i % 2]),
            "OTEL_EXPORTER_OTLP_PROTOCOL": PROTOCOLS[i % 2],
            "OTEL_RESOURCE_ATTRIBUTES": f"{RUN_ATTR}={i}"}} for i in range(SOAK_RUNS)]
        plan = {"config": {"model": tiny_model, "speculative_config": NGRAM, "max_tokens": 16},
                "runs": runs}
        results, stderr = run_plan_in_child(
            plan, with_child_site(clean_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")), timeout=1200)
        store = receiver.store
    delivered = [r["label"] for r in results
                 if store.spec_decode_totals({RUN_ATTR: r["label"]}) == r["vllm"]]
    assert all(r["vllm"]["drafts"] > 0 for r in results)
    assert len(delivered) == SOAK_RUNS, (
        sorted(set(r["label"] for r in results) - set(delivered), key=int),
        [line for line in stderr.splitlines() if "otel_specdec" in line][-40:])
    assert "WARNING" not in "".join(line for line in stderr.splitlines()
                                    if "otel_specdec" in line)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_engine_killed_before_its_final_export_warns_once(tiny_model, protocol):
    """The engine-core process reaches its final export after vLLM's process
    manager gave up on it (budget 1 s: 5 + 1 + 5 s after SIGTERM): it is
    killed, nothing of the run arrives, and the ``LLM``'s process says so
    once, naming the engine. (Without the export ledger, the loss was
    silent: the only process that knew was the one killed.)"""
    budget_s = 1.0
    # vLLM's grace for an LLM plus the budget plus the teardown margin.
    grace_s = _VLLM_DEFAULT_GRACE_S + budget_s + _TEARDOWN_MARGIN_S
    with OtlpReceiver() as receiver:
        env = with_child_site(
            clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint(protocol),
                      OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
                      **{SHUTDOWN_TIMEOUT_ENV: str(budget_s)}),
            SPECDEC_TEST_EXPORT_DELAY_S=str(grace_s + 4))
        result = run_in_child({"model": tiny_model, "speculative_config": NGRAM,
                               "max_tokens": 16}, env, timeout=420)
        store = receiver.store
    evidence = shutdown_evidence(result, store)
    assert result["vllm"]["drafts"] > 0
    # The ordering happened: vLLM killed the engine before it exported.
    assert "force killing remaining process EngineCore" in result["shutdown_log"], evidence
    assert store.spec_decode_totals()["drafts"] == 0, evidence
    assert grace_s <= result["shutdown_seconds"] < grace_s + 4, evidence
    # And one line says so, from the process that killed it.
    assert result["stderr"].count(LOST_WARNING) == 1, evidence
    [line] = [line for line in result["stderr"].splitlines() if LOST_WARNING in line]
    assert "EngineCore" in line and f"{grace_s:g} s" in line, line


def test_sigterm_taken_by_another_thread_still_delivers_the_run(tiny_model):
    """The SIGTERM goes to a thread of the engine-core process other than its
    main one. Without the wake-up, the idle engine never ran vLLM's handler:
    killed at the grace (21 s), nothing delivered, as in the suite's
    intermittent failures. With it, the engine stops at once and exports."""
    with OtlpReceiver() as receiver:
        env = with_child_site(
            clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint("grpc")),
            SPECDEC_TEST_SIGTERM_TO_THREAD="1")
        result = run_in_child({"model": tiny_model, "speculative_config": NGRAM,
                               "max_tokens": 16}, env, timeout=420)
        store = receiver.store
    evidence = shutdown_evidence(result, store)
    # The ordering happened: a thread other than the main one took it.
    assert "SIGTERM to thread" in result["stderr"], evidence
    assert "trigger received signal=SIGTERM" in result["shutdown_log"], evidence
    assert "force killing" not in result["shutdown_log"], evidence
    assert_delivered(store, result)
    assert LOST_WARNING not in result["stderr"], evidence
