"""Drive vLLM's real ``Scheduler`` with hand-made model outputs.

The scheduler is vLLM's own (built from a real ``VllmConfig`` for the tiny
model); only the model runner is replaced: each step the test decides how
many of each request's draft tokens the "target model" accepts, and what the
drafter proposes next. vLLM's own ``SpecDecodingStats`` for the same steps
are collected, so tests compare the plugin against vLLM itself. Used by the
unit tests and by ``bench/``.
"""

from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from otel_specdec.demo.receiver import add_elementwise

BONUS_TOKEN = 7  # the token the fake target model emits after the accepted prefix

# accept(req_id, drafts) -> number of leading drafts the target accepts
AcceptFn = Callable[[str, list[int]], int]
# propose(req_id) -> draft token ids for the next step (may be empty)
ProposeFn = Callable[[str], list[int]]


# Required constructor arguments of some releases that others lack, with the
# value that means "nothing": Request's multimodal inputs and eos_token_id
# (0.10-0.15), FullAttentionSpec's use_mla (0.10).
_RELEASE_ONLY_DEFAULTS: dict[str, Any] = {
    "eos_token_id": None, "use_mla": False, "multi_modal_inputs": None,
    "multi_modal_hashes": None, "multi_modal_placeholders": None,
}


def construct(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """``cls(*args, **kwargs)`` on any supported vLLM release.

    vLLM's constructors gain and lose parameters between releases (the
    harness runs against each release's own scheduler, see
    ``vllm_releases``): keyword arguments this release's ``cls`` does not
    take are dropped, and required ones it alone has get their neutral
    value. Each dropped argument is a feature the release lacks; the tests
    that need one check ``has_parameter`` and say so.
    """
    params = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    for param in list(params.values())[len(args):]:
        if (param.default is param.empty and param.name not in kwargs
                and param.name in _RELEASE_ONLY_DEFAULTS):
            kwargs[param.name] = _RELEASE_ONLY_DEFAULTS[param.name]
    return cls(*args, **kwargs)


def has_parameter(cls: Any, name: str) -> bool:
    return name in inspect.signature(cls).parameters


def vllm_release() -> tuple[int, int]:
    """The running vLLM's (major, minor), for tests of what a release offers."""
    import vllm

    major, minor = (int(n) for n in vllm.__version__.split(".")[:2])
    return major, minor


def has_field(cls: Any, name: str) -> bool:
    import dataclasses

    return name in {f.name for f in dataclasses.fields(cls)}


@dataclass
class VllmSpecStats:
    """vLLM's own counters, summed over the steps driven so far."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Draft tokens per position: counted by vLLM from 0.24 (empty before).
    draft_per_pos: list[int] = field(default_factory=list)

    def add(self, stats: Any) -> None:
        self.drafts += stats.num_drafts
        self.draft_tokens += stats.num_draft_tokens
        self.accepted_tokens += stats.num_accepted_tokens
        add_elementwise(self.accepted_per_pos, stats.num_accepted_tokens_per_pos)
        add_elementwise(self.draft_per_pos, getattr(stats, "num_draft_tokens_per_pos", []))


def build_scheduler(model_dir: str, num_speculative_tokens: int, *, log_stats: bool = True,
                    max_num_seqs: int = 1024, method: str = "ngram",
                    per_request_metrics: bool = False, async_scheduling: bool = False,
                    served_model_name: str | None = None, num_blocks: int = 200_000,
                    speculative_extra: dict[str, Any] | None = None,
                    kv_transfer_config: dict[str, Any] | None = None) -> Any:
    """vLLM's ``Scheduler`` (``AsyncScheduler`` with ``async_scheduling``).

    ``num_blocks``: KV-cache blocks of 16 tokens; few of them make vLLM
    preempt running requests. ``speculative_extra``: more speculative-config
    settings (``num_speculative_tokens_per_batch_size``, for instance).
    ``kv_transfer_config``: a KV connector for the scheduler.
    """
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": num_speculative_tokens}
    if method == "ngram":
        spec.update(prompt_lookup_max=3, prompt_lookup_min=1)
    spec.update(speculative_extra or {})
    args = construct(
        EngineArgs,
        model=model_dir, speculative_config=spec, max_model_len=512, dtype="float32",
        enforce_eager=True, gpu_memory_utilization=0.15, max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        # The scheduler needs no tokenizer (and 0.11's tokenizer code fails
        # against the venv's newer transformers).
        skip_tokenizer_init=True,
        served_model_name=[served_model_name] if served_model_name else None,
        # vLLM's own per-request counts, reported with each finished request.
        per_request_spec_decode_metrics="summary" if per_request_metrics else "none",
        max_num_batched_tokens=max(8192, max_num_seqs * (num_speculative_tokens + 1) * 2),
        kv_transfer_config=kv_transfer_config,
    )
    vllm_config = args.create_engine_config()
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_spec = construct(FullAttentionSpec, block_size=16, num_kv_heads=1, head_size=64,
                        dtype=torch.float32)
    kv_config = construct(
        KVCacheConfig,
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], kv_spec)],
    )
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    return construct(
        scheduler_cls,
        vllm_config=vllm_config, kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=16, log_stats=log_stats,
    )


class SchedulerHarness:
    """Steps a real scheduler; ``row_order`` is the model runner's batch layout.

    ``"persistent"`` keeps each request in its row as vLLM's ``InputBatch``
    does (a finished request's row is taken by a new one, or by the last row
    when the batch condenses); ``"schedule"`` lists rows in scheduling order
    (rows shift whenever a request finishes); ``"shuffled"`` permutes them
    every step.
    """

    def __init__(self, scheduler: Any, row_order: str = "persistent") -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        self.scheduler = scheduler
        self.vllm = VllmSpecStats()
        # req_id -> (drafted, accepted) from vLLM's per-request metrics, when on
        # (vLLM 0.29+).
        self.vllm_per_request: dict[str, tuple[int, int]] = {}
        # req_id -> (drafted, accepted) as the harness saw them verified: the
        # per-request expectation where vLLM has no per-request metrics.
        # check_own_counts proves it against vLLM's aggregate counters.
        self.own_per_request: dict[str, tuple[int, int]] = {}
        self.own = VllmSpecStats()
        # vLLM 0.11 passes each request's sampled tokens as a numpy array.
        annotation = str(ModelRunnerOutput.__annotations__.get("sampled_token_ids", ""))
        self._numpy_rows = "ndarray" in annotation
        self.row_order = row_order
        self._rows: list[str | None] = []
        self._shuffle = random.Random(0)
        self._ids = itertools.count()

    def add_requests(self, n: int, *, prompt_len: int = 8, max_tokens: int = 400,
                     trace_headers: Callable[[int], dict[str, str] | None] | None = None,
                     ) -> list[str]:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        ids = []
        for i in range(n):
            req_id = f"req-{next(self._ids)}"
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            request = construct(
                Request, request_id=req_id, prompt_token_ids=list(range(10, 10 + prompt_len)),
                sampling_params=params, pooling_params=None,
                trace_headers=trace_headers(i) if trace_headers else None,
            )
            self.scheduler.add_request(request)
            ids.append(req_id)
        return ids

    def schedule(self) -> Any:
        return self.scheduler.schedule()

    def model_output(self, scheduler_output: Any, accept: AcceptFn) -> Any:
        """What a model runner would return for ``scheduler_output``."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = self._layout(list(scheduler_output.num_scheduled_tokens))
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests.get(req_id)  # None: aborted meanwhile
            if request is not None and request.num_computed_tokens < request.num_prompt_tokens:
                sampled.append([])  # partial prefill: no token yet
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            n = accept(req_id, list(drafts)) if drafts else 0
            sampled.append(list(drafts[:n]) + [BONUS_TOKEN])
        if self._numpy_rows:
            import numpy as np

            sampled = [np.array(row, dtype=np.int32) for row in sampled]
        # The batch index left ModelRunnerOutput in 0.34 (the scheduler
        # builds it from req_ids); construct drops it there.
        return construct(
            ModelRunnerOutput,
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            # Required in releases before ~0.11 (no default there).
            spec_token_ids=None, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[],
        )

    def _layout(self, scheduled: list[str]) -> list[str]:
        if self.row_order == "schedule":
            return scheduled
        if self.row_order == "shuffled":
            self._shuffle.shuffle(scheduled)
            return scheduled
        live = set(scheduled)
        rows = [r if r in live else None for r in self._rows]
        placed = set(rows)
        for req_id in scheduled:
            if req_id not in placed:
                if None in rows:
                    rows[rows.index(None)] = req_id
                else:
                    rows.append(req_id)
        while None in rows:  # condense: the last row fills the first hole
            last = rows.pop()
            if last is not None:
                rows[rows.index(None)] = last
        self._rows = rows
        return list(rows)

    def update(self, scheduler_output: Any, model_output: Any) -> Any:
        self._count_own(scheduler_output, model_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        for engine_outputs in outputs.values():
            stats = engine_outputs.scheduler_stats
            if stats is not None and stats.spec_decoding_stats is not None:
                self.vllm.add(stats.spec_decoding_stats)
            for output in engine_outputs.outputs:
                metrics = getattr(output, "spec_decode_metrics", None)
                if metrics is not None and output.finish_reason is not None:
                    self.record_vllm_request(output.request_id, metrics)
        return outputs

    def _count_own(self, scheduler_output: Any, model_output: Any) -> None:
        """The step's verified drafts, per request, by vLLM's current rules.

        A draft counts when its request is still unfinished in the
        scheduler, has output this step, and its output is not stale; its
        drafted tokens exclude grammar-invalidated ones. Older releases
        differ in cases these tests avoid (see docs/compatibility.md);
        ``check_own_counts`` proves the result against vLLM's own counters.
        """
        requests = self.scheduler.requests
        invalid = getattr(scheduler_output, "num_invalid_spec_tokens", None) or {}
        rows = {r: i for i, r in enumerate(model_output.req_ids)}
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            request = requests.get(req_id)
            if not drafts or request is None or request.is_finished():
                continue
            if (getattr(request, "num_stale_output_tokens", 0) > 0
                    and getattr(request, "drop_stale_output", False)):
                continue
            sampled = len(model_output.sampled_token_ids[rows[req_id]])
            if not sampled:
                continue
            drafted, accepted = len(drafts) - invalid.get(req_id, 0), sampled - 1
            seen = self.own_per_request.get(req_id, (0, 0))
            self.own_per_request[req_id] = (seen[0] + drafted, seen[1] + accepted)
            self.own.drafts += 1
            self.own.draft_tokens += drafted
            self.own.accepted_tokens += accepted

    def check_own_counts(self) -> None:
        """The harness's own per-request counts add up to vLLM's counters."""
        assert (self.own.drafts, self.own.draft_tokens, self.own.accepted_tokens) == (
            self.vllm.drafts, self.vllm.draft_tokens, self.vllm.accepted_tokens
        )

    def per_request(self) -> dict[str, tuple[int, int]]:
        """req_id -> (drafted, accepted): vLLM's own where it reports them
        (0.29+, with per-request metrics on), else the harness's."""
        self.check_own_counts()
        if self.vllm_per_request:
            own = {r: c for r, c in self.own_per_request.items() if r in self.vllm_per_request}
            diff = {r: (c, own.get(r)) for r, c in self.vllm_per_request.items()
                    if own.get(r, (0, 0)) != c}
            assert not diff, diff
            return self.vllm_per_request
        return self.own_per_request

    def record_vllm_request(self, req_id: str, metrics: Any) -> None:
        """Keep vLLM's per-request counts (``RequestSpecDecodeMetrics``)."""
        accepted = sum(j * n for j, n in enumerate(metrics.histogram))
        self.vllm_per_request[req_id] = (metrics.num_draft_tokens, accepted)

    def abort(self, req_id: str) -> None:
        """Abort a request, keeping vLLM's per-request counts up to now."""
        from vllm.v1.request import RequestStatus

        metrics = getattr(self.scheduler.requests[req_id], "spec_decode_metrics", None)
        if metrics is not None:
            self.record_vllm_request(req_id, metrics)
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def propose(self, scheduler_output: Any, propose: ProposeFn) -> None:
        from vllm.v1 import outputs

        DraftTokenIds = getattr(outputs, "DraftTokenIds", None)  # noqa: N806

        requests = self.scheduler.requests
        req_ids = [r for r in scheduler_output.num_scheduled_tokens if r in requests]
        drafts = [propose(r) for r in req_ids]
        if not hasattr(self.scheduler, "update_draft_token_ids"):
            # Releases before the drafter's own output (0.10) take drafts in
            # ModelRunnerOutput.spec_token_ids, and their update_from_output
            # sets them on each request it did not free, as done here.
            for req_id, req_drafts in zip(req_ids, drafts, strict=True):
                requests[req_id].spec_token_ids = req_drafts
            return
        self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    def step(self, accept: AcceptFn, propose: ProposeFn) -> Any:
        scheduler_output = self.schedule()
        outputs = self.update(scheduler_output, self.model_output(scheduler_output, accept))
        self.propose(scheduler_output, propose)
        return scheduler_output, outputs
