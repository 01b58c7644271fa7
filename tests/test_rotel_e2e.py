"""End to end through a real collector: vLLM (CPU build, engine core in its
own process, the plugin loaded through vLLM's entry point) exports OTLP/gRPC
to rotel-agent, started in the foreground from the shipped
``collector-config/rotel.env`` with only its ports and exporter endpoint set
in the environment; rotel forwards OTLP/gRPC to a receiver on loopback. The
totals that arrive through the collector must equal vLLM's own counters.

The export interval is left at its default (60 s), so what arrives is the
plugin's final export at engine shutdown, batched and forwarded by rotel.
"""

from __future__ import annotations

import pytest
from engine_child import run_in_child
from fault_helpers import clean_env
from rotel_helpers import RotelAgent, agent_version, require_rotel_agent

from otel_specdec.demo.receiver import OtlpReceiver

pytestmark = pytest.mark.engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}

# rotel forwards a batch after ROTEL_BATCH_TIMEOUT (1 s in rotel.env); its
# first retry comes 5 s after a failed send. Generous for a loaded machine.
FORWARD_WAIT_S = 30


def test_totals_through_rotel_equal_vllm(tiny_model):
    agent = require_rotel_agent()
    with OtlpReceiver() as receiver:
        store = receiver.store
        rotel = RotelAgent(agent, receiver.endpoint("grpc"))
        try:
            rotel.start()
            result = run_in_child(
                {"model": tiny_model, "speculative_config": NGRAM},
                clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=rotel.endpoint("grpc"),
                          OTEL_EXPORTER_OTLP_PROTOCOL="grpc"),
                timeout=420,
            )
            vllm = result["vllm"]
            assert vllm["drafts"] > 0
            store.wait_for(lambda: store.spec_decode_totals() == vllm, FORWARD_WAIT_S)
            assert store.spec_decode_totals() == vllm, (
                f"through {agent_version(agent)}: {rotel.log()[-4000:]}")
        finally:
            rotel.stop()
        assert rotel.returncode == 0, rotel.log()

    length = store.histogram_total("vllm.spec_decode.acceptance_length")
    assert length.count == vllm["drafts"]
    assert length.sum == vllm["drafts"] + vllm["accepted_tokens"]
    # rotel passes the resource through: every series keeps the engine
    # process's identity.
    for series in store.series("vllm.spec_decode.drafts"):
        assert series.resource["service.name"] == "vllm"
        assert series.resource["service.instance.id"]
