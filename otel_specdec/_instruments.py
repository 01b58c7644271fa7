"""Instrument names, units and descriptions: the metric contract in one place.

``docs/metrics.md`` documents each of these; a rename here is a breaking
change for every dashboard and alert rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

METER_NAME: Final = "otel_specdec"

# Attribute keys.
ATTR_MODEL: Final = "gen_ai.request.model"
ATTR_METHOD: Final = "vllm.spec_decode.method"
ATTR_NUM_SPEC_TOKENS: Final = "vllm.spec_decode.num_speculative_tokens"
ATTR_POSITION: Final = "vllm.spec_decode.position"

# Resource keys for per-process identity.
RES_DP_RANK: Final = "vllm.data_parallel.rank"
RES_ENGINE_INDEX: Final = "vllm.engine.index"

# Longest served-model name kept as an attribute value; longer ones are cut.
MAX_MODEL_NAME_LEN: Final = 256

# Counters (exported as observable counters read at collection time).
DRAFTS: Final = "vllm.spec_decode.drafts"
DRAFT_TOKENS: Final = "vllm.spec_decode.draft_tokens"
ACCEPTED_TOKENS: Final = "vllm.spec_decode.accepted_tokens"
EMPTY_PROPOSALS: Final = "vllm.spec_decode.empty_proposals"
PADDING_TOKENS: Final = "vllm.spec_decode.padding_tokens"

# Histograms (exported from pre-aggregated bucket counts).
ACCEPTANCE_LENGTH: Final = "vllm.spec_decode.acceptance_length"
REQUEST_ACCEPTANCE_RATE: Final = "vllm.spec_decode.request.acceptance_rate"

UNIT_DRAFT: Final = "{draft}"
UNIT_TOKEN: Final = "{token}"
UNIT_PROPOSAL: Final = "{proposal}"
UNIT_RATIO: Final = "1"

COUNTER: Final = "Counter"
HISTOGRAM: Final = "Histogram"


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: the contract a dashboard or alert relies on.

    ``attributes``: attribute keys beyond the common ones (model, method, k).
    """

    name: str
    instrument: str  # COUNTER or HISTOGRAM
    unit: str
    attributes: tuple[str, ...]
    description: str


# The metric contract, in the order the docs list it. The exporter builds
# every instrument from this table; tests/test_contract.py checks the
# README's table and docs/metrics.md against it.
METRICS: Final = (
    MetricSpec(DRAFTS, COUNTER, UNIT_DRAFT, (),
               "Request-steps in which at least one draft token was verified."),
    MetricSpec(DRAFT_TOKENS, COUNTER, UNIT_TOKEN, (ATTR_POSITION,),
               "Draft tokens verified by the target model, by draft position."),
    MetricSpec(ACCEPTED_TOKENS, COUNTER, UNIT_TOKEN, (ATTR_POSITION,),
               "Draft tokens accepted (the accepted prefix), by draft position."),
    MetricSpec(ACCEPTANCE_LENGTH, HISTOGRAM, UNIT_TOKEN, (),
               "Tokens emitted per draft: 1 + accepted draft tokens (the bonus token "
               "included); sum/count is vLLM's mean acceptance length."),
    MetricSpec(REQUEST_ACCEPTANCE_RATE, HISTOGRAM, UNIT_RATIO, (),
               "Per finished request that had at least one draft: accepted / drafted "
               "tokens."),
    MetricSpec(EMPTY_PROPOSALS, COUNTER, UNIT_PROPOSAL, (),
               "Decode request-steps of a speculative engine in which no draft token "
               "was verified (the drafter proposed nothing)."),
    MetricSpec(PADDING_TOKENS, COUNTER, UNIT_TOKEN, (),
               "Verified draft slots that held vLLM's padding sentinel instead of a "
               "proposed token; included in draft_tokens, as vLLM counts them."),
)
METRIC_BY_NAME: Final = {spec.name: spec for spec in METRICS}
# Every point carries these (docs/metrics.md, "Attributes").
COMMON_ATTRIBUTES: Final = (ATTR_MODEL, ATTR_METHOD, ATTR_NUM_SPEC_TOKENS)

# Explicit bucket bounds of the per-request acceptance rate: 0, 0.1, ..., 1.
REQUEST_RATE_BOUNDS: Final = tuple(i / 10 for i in range(11))


def acceptance_length_bounds(num_speculative_tokens: int) -> tuple[float, ...]:
    """Bounds 1, 2, ..., k+1: one bucket per possible acceptance length."""
    return tuple(float(i) for i in range(1, num_speculative_tokens + 2))


# --- Per-request spans (``OTEL_SPECDEC_TRACES=true``; docs/traces.md) -------

TRACER_NAME: Final = METER_NAME
SPAN_REQUEST: Final = "vllm.spec_decode.request"

SPAN_DRAFTS: Final = "vllm.spec_decode.drafts"
SPAN_DRAFT_TOKENS: Final = "vllm.spec_decode.draft_tokens"
SPAN_ACCEPTED_TOKENS: Final = "vllm.spec_decode.accepted_tokens"
SPAN_ACCEPTANCE_RATE: Final = "vllm.spec_decode.acceptance_rate"
SPAN_MEAN_ACCEPTANCE_LENGTH: Final = "vllm.spec_decode.mean_acceptance_length"
SPAN_DRAFT_TOKENS_PER_POSITION: Final = "vllm.spec_decode.draft_tokens_per_position"
SPAN_ACCEPTED_TOKENS_PER_POSITION: Final = "vllm.spec_decode.accepted_tokens_per_position"
SPAN_ACCEPTANCE_LENGTH_COUNTS: Final = "vllm.spec_decode.acceptance_length_counts"
# OpenTelemetry GenAI semantic conventions (string array).
SPAN_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
