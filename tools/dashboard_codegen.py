"""Generate the otel-specdec Grafana dashboard with grafana-foundation-sdk.

    python -m tools.dashboard_codegen            # (re)write dashboards/otel-specdec.json
    python -m tools.dashboard_codegen --check    # exit 1 if the committed file is stale

The JSON is deterministic: sorted keys, fixed uid and panel ids, no timestamps.
Every query uses the raw metrics (no recording rules) and the selectors
``gen_ai_request_model=~"$model"``, ``vllm_spec_decode_method=~"$method"`` and
``instance=~"$instance"``. See docs/dashboard.md and docs/metrics.md.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

OUTPUT = Path(__file__).resolve().parents[1] / "dashboards" / "otel-specdec.json"

UID = "otel-specdec"
TITLE = "vLLM speculative decoding (otel-specdec)"

# Prometheus names of the plugin's metrics (docs/metrics.md, "Names in Prometheus").
DRAFTS = "vllm_spec_decode_drafts_total"
DRAFT_TOKENS = "vllm_spec_decode_draft_tokens_total"
ACCEPTED_TOKENS = "vllm_spec_decode_accepted_tokens_total"
EMPTY_PROPOSALS = "vllm_spec_decode_empty_proposals_total"
PADDING_TOKENS = "vllm_spec_decode_padding_tokens_total"
ACCEPTANCE_LENGTH_BUCKET = "vllm_spec_decode_acceptance_length_bucket"
REQUEST_RATE_BUCKET = "vllm_spec_decode_request_acceptance_rate_bucket"

# Template variables.
DATASOURCE_VAR = "datasource"
MODEL_VAR = "model"
METHOD_VAR = "method"
INSTANCE_VAR = "instance"
COST_RATIO_VAR = "cost_ratio"
COST_RATIO_DEFAULT = "0.05"

# Every selector carries these matchers; every aggregation by model and method
# sums over instances (engine processes) and jobs.
SELECTOR = (
    f'gen_ai_request_model=~"${MODEL_VAR}", '
    f'vllm_spec_decode_method=~"${METHOD_VAR}", '
    f'instance=~"${INSTANCE_VAR}"'
)
BY_MODEL_METHOD = "gen_ai_request_model, vllm_spec_decode_method"
LEGEND = "{{gen_ai_request_model}} {{vllm_spec_decode_method}}"

DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")


# --- PromQL -----------------------------------------------------------------


def _indent(text: str, spaces: int = 2) -> str:
    pad = " " * spaces
    return "\n".join(pad + line for line in text.splitlines())


def _sum_rate(metric: str, by: str = BY_MODEL_METHOD) -> str:
    return f"sum by ({by}) (rate({metric}{{{SELECTOR}}}[$__rate_interval]))"


def _ratio(numerator: str, denominator: str) -> str:
    """numerator / denominator, with series whose denominator is 0 dropped (no NaN)."""
    if "\n" in denominator:
        denominator = _paren(f"{denominator}\n> 0")
    else:
        denominator = f"({denominator} > 0)"
    return f"{numerator}\n/\n{denominator}"


def _paren(expr: str) -> str:
    return f"(\n{_indent(expr)}\n)"


# accepted draft tokens per verified draft token, by model and method (vLLM's
# "draft acceptance rate"). Not α: accepted tokens are a prefix of each draft.
ACCEPTANCE_RATE = _ratio(_sum_rate(ACCEPTED_TOKENS), _sum_rate(DRAFT_TOKENS))

# 1 + accepted / drafts: tokens emitted per draft, bonus token included.
MEAN_ACCEPTANCE_LENGTH = "1 +\n" + _paren(_ratio(_sum_rate(ACCEPTED_TOKENS), _sum_rate(DRAFTS)))

# accepted at position p / drafts (vLLM's per-position acceptance rate).
PER_POSITION_ACCEPTANCE = (
    f"{_sum_rate(ACCEPTED_TOKENS, f'{BY_MODEL_METHOD}, vllm_spec_decode_position')}\n"
    # group_left's empty label list keeps the parenthesised denominator from
    # being read as the label list.
    f"/ on ({BY_MODEL_METHOD}) group_left ()\n"
    f"({_sum_rate(DRAFTS)} > 0)"
)

# Drafts per second in each acceptance-length bucket (cumulative `le` buckets;
# Grafana's heatmap format turns them into per-bucket counts).
ACCEPTANCE_LENGTH_HEATMAP = _sum_rate(ACCEPTANCE_LENGTH_BUCKET, "le")


def _request_quantile(q: str) -> str:
    inner = _sum_rate(REQUEST_RATE_BUCKET, f"le, {BY_MODEL_METHOD}")
    return f"histogram_quantile(\n  {q},\n{_indent(inner)}\n)"


REQUEST_RATE_QUANTILES = (("p10", "0.1"), ("p50", "0.5"), ("p90", "0.9"))

DRAFTED_TOKENS_PER_SECOND = _sum_rate(DRAFT_TOKENS)
ACCEPTED_TOKENS_PER_SECOND = _sum_rate(ACCEPTED_TOKENS)
PADDING_TOKENS_PER_SECOND = _sum_rate(PADDING_TOKENS)

# Decode request-steps of the drafter's engine that had a draft or an empty proposal.
_DRAFT_OPPORTUNITIES = _paren(f"{_sum_rate(DRAFTS)}\n+\n{_sum_rate(EMPTY_PROPOSALS)}")

# empty_proposals / (drafts + empty_proposals).
ZERO_PROPOSAL_SHARE = _ratio(_sum_rate(EMPTY_PROPOSALS), _DRAFT_OPPORTUNITIES)

# k per (model, method): the number of position series (0..k-1), which exist
# from engine start with value 0.
NUM_SPECULATIVE_TOKENS = (
    f"count by ({BY_MODEL_METHOD}) (\n"
    f"  count by ({BY_MODEL_METHOD}, vllm_spec_decode_position) "
    f"({DRAFT_TOKENS}{{{SELECTOR}}})\n"
    ")"
)

# Drafts that accepted all k tokens: accepted[k-1], the smallest per-position
# accepted count (accepted tokens are a prefix, so the count falls with the position).
FULLY_ACCEPTED_DRAFTS = (
    f"min by ({BY_MODEL_METHOD}) (\n"
    + _indent(_sum_rate(ACCEPTED_TOKENS, f"{BY_MODEL_METHOD}, vllm_spec_decode_position"))
    + "\n)"
)

# α, the per-token acceptance probability of Leviathan et al.: accepted / trials,
# as in the recording rule model_method:vllm_spec_decode_conditional_acceptance_rate:rate5m
# (docs/prometheus-rules.md). Each draft tries positions 0, 1, ... until its first
# rejection or position k-1, so trials = accepted + drafts - accepted[k-1].
# drafts - accepted[k-1] (the drafts that ended in a rejection) is computed first,
# so that when every draft was fully accepted it is exactly 0 and α exactly 1.
PER_TOKEN_ACCEPTANCE = _ratio(
    _sum_rate(ACCEPTED_TOKENS),
    f"{_sum_rate(ACCEPTED_TOKENS)}\n+\n"
    + _paren(f"{_sum_rate(DRAFTS)}\n-\n{FULLY_ACCEPTED_DRAFTS}"),
)

_ALPHA = _paren(PER_TOKEN_ACCEPTANCE)
_K = _paren(NUM_SPECULATIVE_TOKENS)
# k·c + 1: the cost of one speculative step in target-model forward passes.
_STEP_COST = f"({_K} * ${COST_RATIO_VAR} + 1)"

# Leviathan et al. (2023): (1 - α^(k+1)) / ((1 - α)(k·c + 1)), α the per-token
# acceptance probability above. For α = 1 the closed form is 0/0; its limit
# (k + 1) / (k·c + 1) is used instead (the recording rule caps α at 0.999999
# instead; below that the two agree exactly).
EXPECTED_SPEEDUP = (
    "(\n"
    + _indent(
        "(\n"
        + _indent(f"(1 - {_ALPHA} ^ ({_K} + 1))\n/\n((1 - {_ALPHA}) > 0)")
        + "\n)\n"
        + f"or on ({BY_MODEL_METHOD})\n"
        + "(\n"
        + _indent(f"({_K} + 1)\nand on ({BY_MODEL_METHOD})\n({_ALPHA} >= 1)")
        + "\n)"
    )
    + "\n)\n/\n"
    + _STEP_COST
)

# The same cost model with the measured tokens per step (mean acceptance length).
MEASURED_SPEEDUP = _paren(MEAN_ACCEPTANCE_LENGTH) + "\n/\n" + _STEP_COST

# accepted / (k × (drafts + empty_proposals)).
SYSTEM_EFFICIENCY = _ratio(_sum_rate(ACCEPTED_TOKENS), f"{_DRAFT_OPPORTUNITIES}\n*\n{_K}")

_BY_INSTANCE = f"{BY_MODEL_METHOD}, instance"
ACCEPTANCE_RATE_BY_INSTANCE = _ratio(
    _sum_rate(ACCEPTED_TOKENS, _BY_INSTANCE), _sum_rate(DRAFT_TOKENS, _BY_INSTANCE)
)


# --- Panels -----------------------------------------------------------------

HEIGHT = 8
HALF = 12
FULL = 24


def _query(expr: str, legend: str, ref_id: str = "A") -> prometheus.Dataquery:
    return (
        prometheus.Dataquery()
        .ref_id(ref_id)
        .datasource(DATASOURCE)
        .expr(expr)
        .legend_format(legend)
        .range()
        .editor_mode(prometheus_models.QueryEditorMode.CODE)
    )


def _legend() -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["mean", "lastNotNull"])
    )


def _tooltip() -> common_builders.VizTooltipOptions:
    return (
        common_builders.VizTooltipOptions()
        .mode(common.TooltipDisplayMode.MULTI)
        .sort(common.SortOrder.DESCENDING)
    )


def _timeseries(
    title: str,
    description: str,
    queries: list[prometheus.Dataquery],
    unit: str,
    width: int = HALF,
    min_val: float | None = 0,
    max_val: float | None = None,
    decimals: float | None = None,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(queries)
        .unit(unit)
        .height(HEIGHT)
        .span(width)
        .line_width(1)
        .fill_opacity(10)
        .show_points(common.VisibilityMode.NEVER)
        .span_nulls(False)
        .legend(_legend())
        .tooltip(_tooltip())
    )
    if min_val is not None:
        panel = panel.min(min_val)
    if max_val is not None:
        panel = panel.max(max_val)
    if decimals is not None:
        panel = panel.decimals(decimals)
    return panel


def _acceptance_rate_panel() -> timeseries.Panel:
    return _timeseries(
        "Acceptance rate",
        "Accepted draft tokens / verified draft tokens, by model and method, summed over "
        "instances (vLLM's draft acceptance rate). Lower than the per-token α of the "
        "speedup formula, since only a prefix of each draft can be accepted.",
        [_query(ACCEPTANCE_RATE, LEGEND)],
        "percentunit",
        max_val=1,
    )


def _mean_acceptance_length_panel() -> timeseries.Panel:
    return _timeseries(
        "Mean acceptance length",
        "Tokens emitted per draft, bonus token included: 1 + accepted tokens / drafts "
        "(vLLM's mean acceptance length). Ranges from 1 to k + 1.",
        [_query(MEAN_ACCEPTANCE_LENGTH, LEGEND)],
        "none",
        min_val=1,
        decimals=2,
    )


def _per_position_panel() -> timeseries.Panel:
    return _timeseries(
        "Per-position acceptance rate",
        "Share of drafts whose token at each position (0-based) was accepted: accepted "
        "tokens at the position / drafts. Falls with the position, because acceptance "
        "stops at the first rejected token.",
        [
            _query(
                PER_POSITION_ACCEPTANCE,
                LEGEND + " pos {{vllm_spec_decode_position}}",
            )
        ],
        "percentunit",
        max_val=1,
    )


def _acceptance_length_heatmap_panel() -> heatmap.Panel:
    return (
        heatmap.Panel()
        .title("Acceptance length distribution")
        .description(
            "Drafts per second by acceptance length (1 + accepted tokens, bonus included), "
            "from the acceptance_length histogram, summed over the selected models, "
            "methods and instances. Select one model and method to read one k."
        )
        .datasource(DATASOURCE)
        .targets(
            [
                _query(ACCEPTANCE_LENGTH_HEATMAP, "{{le}}").format(
                    prometheus_models.PromQueryFormat.HEATMAP
                )
            ]
        )
        .height(HEIGHT)
        .span(FULL)
        .calculate(False)
        .rows_frame(
            heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE).value("drafts/s")
        )
        .y_axis(heatmap.YAxisConfig().unit("none").decimals(0).axis_label("acceptance length"))
        .color(
            heatmap.HeatmapColorOptions()
            .mode(heatmap_models.HeatmapColorMode.SCHEME)
            .scheme("Oranges")
            .scale(heatmap_models.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .fill("dark-orange")
            .steps(64)
            .reverse(False)
        )
        .cell_values(heatmap.CellValues().unit("short").decimals(2))
        .show_value(common.VisibilityMode.NEVER)
        .show_legend()
        .show_tooltip()
        .show_y_histogram()
    )


def _request_percentiles_panel() -> timeseries.Panel:
    return _timeseries(
        "Per-request acceptance rate (p10 / p50 / p90)",
        "Percentiles of accepted / drafted tokens per finished request, by model and "
        "method, over requests that finished in the window. Interpolated within "
        "0.1-wide buckets.",
        [
            _query(_request_quantile(q), f"{name} {LEGEND}", ref_id)
            for ref_id, (name, q) in zip("ABC", REQUEST_RATE_QUANTILES, strict=True)
        ],
        "percentunit",
        max_val=1,
    )


def _tokens_per_second_panel() -> timeseries.Panel:
    return _timeseries(
        "Drafted vs accepted tokens per second",
        "Verified draft tokens and accepted draft tokens per second, by model and method. "
        "Padding: verified slots that held vLLM's -1 padding (included in drafted; "
        "0 under async scheduling).",
        [
            _query(DRAFTED_TOKENS_PER_SECOND, f"drafted {LEGEND}", "A"),
            _query(ACCEPTED_TOKENS_PER_SECOND, f"accepted {LEGEND}", "B"),
            _query(PADDING_TOKENS_PER_SECOND, f"padding {LEGEND}", "C"),
        ],
        "short",
    )


def _zero_proposal_panel() -> timeseries.Panel:
    return _timeseries(
        "Zero-proposal share",
        "Decode steps in which the drafter proposed nothing (an ngram miss, for example): "
        "empty proposals / (drafts + empty proposals).",
        [_query(ZERO_PROPOSAL_SHARE, LEGEND)],
        "percentunit",
        max_val=1,
    )


def _speedup_panel() -> timeseries.Panel:
    return _timeseries(
        "Expected speedup (Leviathan et al.)",
        "(1 - α^(k+1)) / ((1 - α)(k·c + 1)), with α the per-token acceptance probability "
        "accepted / (accepted + drafts - accepted[k-1]), k the number of position series and "
        "c the draft/target cost ratio ($cost_ratio). 'measured' puts the mean acceptance "
        "length in place of (1 - α^(k+1)) / (1 - α). A model, not a latency measurement.",
        [
            _query(EXPECTED_SPEEDUP, f"Leviathan {LEGEND}", "A"),
            _query(MEASURED_SPEEDUP, f"measured {LEGEND}", "B"),
        ],
        "x",
        min_val=None,
        decimals=2,
    )


def _system_efficiency_panel() -> timeseries.Panel:
    return _timeseries(
        "System efficiency",
        "Share of all draft slots that ended up accepted: accepted / (k × (drafts + empty "
        "proposals)). Unlike the acceptance rate it also counts steps with no proposal.",
        [_query(SYSTEM_EFFICIENCY, LEGEND)],
        "percentunit",
        max_val=1,
    )


def _k_panel() -> stat.Panel:
    return (
        stat.Panel()
        .title("Speculative tokens (k)")
        .description(
            "k per model and method: the number of draft positions reported by the "
            "selected instances. Used by the speedup and efficiency panels."
        )
        .datasource(DATASOURCE)
        .targets([_query(NUM_SPECULATIVE_TOKENS, LEGEND).instant()])
        .unit("none")
        .decimals(0)
        .height(HEIGHT)
        .span(HALF)
        .color_mode(common.BigValueColorMode.NONE)
        .graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def _per_instance_panel() -> timeseries.Panel:
    return _timeseries(
        "Acceptance rate by instance",
        "Accepted / verified draft tokens per engine process (instance label = "
        "service.instance.id), by model and method. Outliers point at one engine.",
        [_query(ACCEPTANCE_RATE_BY_INSTANCE, "{{instance}} " + LEGEND)],
        "percentunit",
        width=FULL,
        max_val=1,
    )


# --- Variables and dashboard ------------------------------------------------


def _label_values_variable(name: str, label: str, query: str, description: str):
    return (
        dashboard_builders.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dashboard_models.VariableOption(selected=True, text="All", value="$__all"))
    )


def _variables() -> list[Any]:
    return [
        dashboard_builders.DatasourceVariable(DATASOURCE_VAR)
        .label("Data source")
        .type("prometheus"),
        _label_values_variable(
            MODEL_VAR,
            "Model",
            f"label_values({DRAFTS}, gen_ai_request_model)",
            "Served model name (gen_ai_request_model).",
        ),
        _label_values_variable(
            METHOD_VAR,
            "Method",
            f'label_values({DRAFTS}{{gen_ai_request_model=~"${MODEL_VAR}"}}, '
            "vllm_spec_decode_method)",
            "Speculative method (vllm_spec_decode_method).",
        ),
        _label_values_variable(
            INSTANCE_VAR,
            "Instance",
            f'label_values({DRAFTS}{{gen_ai_request_model=~"${MODEL_VAR}", '
            f'vllm_spec_decode_method=~"${METHOD_VAR}"}}, instance)',
            "Engine process (service.instance.id).",
        ),
        dashboard_builders.TextBoxVariable(COST_RATIO_VAR)
        .label("Draft/target cost ratio c")
        .description(
            "Cost of one draft-model forward pass relative to one target-model pass, "
            "used by the expected speedup. About 0 for ngram; measure it for draft models."
        )
        .default_value(COST_RATIO_DEFAULT)
        .current(
            dashboard_models.VariableOption(
                selected=True, text=COST_RATIO_DEFAULT, value=COST_RATIO_DEFAULT
            )
        ),
    ]


def _row(title: str) -> dashboard_builders.Row:
    return dashboard_builders.Row(title)


def build() -> dict[str, Any]:
    """The dashboard as a JSON-ready dict."""
    builder = (
        dashboard_builders.Dashboard(TITLE)
        .uid(UID)
        .description(
            "Speculative decoding in vLLM from the otel-specdec OpenTelemetry metrics: "
            "acceptance, acceptance length, per-position acceptance, expected speedup."
        )
        .tags(["vllm", "speculative-decoding", "opentelemetry"])
        .editable()
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .timezone("browser")
        .refresh("30s")
        .variables(_variables())
    )
    builder = (
        builder.with_row(_row("Acceptance"))
        .with_panel(_acceptance_rate_panel())
        .with_panel(_mean_acceptance_length_panel())
        .with_panel(_per_position_panel())
        .with_panel(_request_percentiles_panel())
        .with_panel(_acceptance_length_heatmap_panel())
        .with_row(_row("Throughput and efficiency"))
        .with_panel(_tokens_per_second_panel())
        .with_panel(_zero_proposal_panel())
        .with_panel(_speedup_panel())
        .with_panel(_system_efficiency_panel())
        .with_panel(_k_panel())
        .with_row(_row("Per instance").with_panel(_per_instance_panel()))
    )
    data = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    _number_panels(data["panels"])
    return data


def _number_panels(panels: list[dict[str, Any]], start: int = 1) -> int:
    """Fixed panel ids in layout order (rows and nested panels included)."""
    next_id = start
    for panel in panels:
        panel["id"] = next_id
        next_id += 1
        next_id = _number_panels(panel.get("panels") or [], next_id)
    return next_id


def render() -> str:
    """The dashboard JSON exactly as committed."""
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if the file differs from what the generator produces",
    )
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT}")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current == text:
            print(f"{args.output}: up to date")
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=f"{args.output} (committed)",
            tofile=f"{args.output} (generated)",
            n=2,
        )
        sys.stdout.writelines(list(diff)[:200])
        print(
            f"{args.output} is stale: run `python -m tools.dashboard_codegen`",
            file=sys.stderr,
        )
        return 1
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
