"""A KV connector that holds every finished request's blocks, as a
disaggregated-prefill producer does while the decode side pulls them.

vLLM then keeps a finished request in ``Scheduler.requests`` (its free is
delayed) until the connector reports the transfer done; with steps in
flight (async scheduling) that request can still be in a step's output, and
vLLM skips it there because it is finished. The test registers this class
through vLLM's own connector factory (``kv_transfer_config``); the
scheduler calls it as it calls any connector. Nothing moves: no worker side
runs in the scheduler-level tests.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

MODULE = __name__
CLASS = "DelayingConnector"


class DelayingConnector(KVConnectorBase_V1):
    """Scheduler side: no external hits, and every finished request's free is
    delayed (``request_finished`` returns True)."""

    held: set[str] = set()

    # Scheduler side.
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        type(self).held.add(request.request_id)
        return True, None

    # Worker side: never called here (no worker).
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError
