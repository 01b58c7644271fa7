"""Everything that depends on vLLM's internals, in one place.

Patch target: ``vllm.v1.core.sched.scheduler.Scheduler`` (vLLM V1). The
plugin reads, and never writes:

* each step's inputs, named in ``STEP_FIELDS`` (the C pass reads the same
  names): ``SchedulerOutput.scheduled_spec_decode_tokens`` (req_id -> draft
  ids), ``.num_scheduled_tokens``, ``.finished_req_ids`` and, where present,
  ``.num_invalid_spec_tokens`` (grammar-invalidated drafts, added in later
  0.x releases); ``ModelRunnerOutput.sampled_token_ids``,
  ``.req_id_to_index``, ``.req_ids`` and ``.kv_connector_output``;
* ``Scheduler.requests``, ``.finished_req_ids``,
  ``.num_sampled_tokens_per_step`` (1 where absent), ``.vllm_config``.

When vLLM renames any of these, ``check_scheduler`` reports it and the
plugin stays inactive with one warning instead of miscounting.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

from otel_specdec._instruments import (
    ATTR_METHOD,
    ATTR_MODEL,
    ATTR_NUM_SPEC_TOKENS,
    MAX_MODEL_NAME_LEN,
)

__all__ = [
    "SCHEDULER_MODULE",
    "EngineInfo",
    "check_scheduler",
    "engine_info",
    "step_inputs",
]

_logger = logging.getLogger(__name__)

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
SCHEDULER_CLASS = "Scheduler"

# Methods wrapped on the scheduler class; the first two are required.
REQUIRED_METHODS = ("__init__", "update_from_output")
OPTIONAL_METHODS = ("finish_requests", "shutdown")

# vLLM's set of requests freed since the last schedule: on the scheduler it
# fills as requests are freed; ``schedule()`` hands it to the step's
# ``SchedulerOutput`` (same attribute name) and starts a new one.
FINISHED_IDS_ATTR = "finished_req_ids"


class StepFields(NamedTuple):
    """Where one step's inputs are: the attribute names the accounting reads.

    The C pass (``_rowscan.Scanner.step``) takes them in this order, and
    ``step_inputs`` reads the same names. A missing optional field is
    treated as empty; a missing required one sends the step to the exact
    path, which ``check_scheduler`` has vetted.
    """

    # On SchedulerOutput.
    spec_tokens: str = "scheduled_spec_decode_tokens"
    num_scheduled: str = "num_scheduled_tokens"
    invalid_spec_tokens: str = "num_invalid_spec_tokens"  # optional (vLLM ~0.9+)
    finished_ids: str = FINISHED_IDS_ATTR  # optional
    # On ModelRunnerOutput.
    sampled: str = "sampled_token_ids"
    row_of: str = "req_id_to_index"
    rows: str = "req_ids"  # optional: without the row order the exact path is used
    kv_output: str = "kv_connector_output"  # optional
    # On its KVConnectorOutput: requests whose external KV load failed.
    kv_failed: str = "failed_recving"  # optional


STEP_FIELDS = StepFields()

_SCHEDULER_OUTPUT_FIELDS = (STEP_FIELDS.spec_tokens, STEP_FIELDS.num_scheduled)
_MODEL_RUNNER_OUTPUT_FIELDS = (STEP_FIELDS.sampled, STEP_FIELDS.row_of)


@dataclass(frozen=True)
class EngineInfo:
    """What the plugin needs to know about one scheduler's engine."""

    model: str
    method: str
    num_speculative_tokens: int
    data_parallel_rank: int
    num_sampled_per_step: int
    async_scheduling: bool
    # Steps that can be in flight while another is updated: 1 with async
    # scheduling, pipeline_parallel_size - 1 more with pipeline parallelism.
    # Then a freed or preempted request can still be in a step's output.
    steps_in_flight: int

    @property
    def attributes(self) -> dict[str, Any]:
        return {
            ATTR_MODEL: self.model,
            ATTR_METHOD: self.method,
            ATTR_NUM_SPEC_TOKENS: self.num_speculative_tokens,
        }


def _field_names(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
        names.update(getattr(klass, "__struct_fields__", ()))
    return names


def has_method(cls: type, name: str) -> bool:
    """``cls`` implements ``name`` (an abstract one of its interface does not count)."""
    method = getattr(cls, name, None)
    return callable(method) and not getattr(method, "__isabstractmethod__", False)


def check_scheduler() -> tuple[type | None, str | None]:
    """Import the scheduler class and check the fields the plugin reads.

    Returns ``(Scheduler, None)`` when supported, else ``(None, reason)``.
    """
    try:
        from vllm.v1.core.sched import scheduler as scheduler_module
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.outputs import ModelRunnerOutput
    except Exception as exc:  # ImportError, or vLLM failing to import at all
        return None, f"vLLM V1 scheduler not importable ({type(exc).__name__}: {exc})"
    scheduler_cls = getattr(scheduler_module, SCHEDULER_CLASS, None)
    if scheduler_cls is None:
        return None, f"{SCHEDULER_MODULE} has no {SCHEDULER_CLASS}"
    missing = [m for m in REQUIRED_METHODS if not has_method(scheduler_cls, m)]
    missing += [
        f"SchedulerOutput.{f}"
        for f in _SCHEDULER_OUTPUT_FIELDS
        if f not in _field_names(SchedulerOutput)
    ]
    missing += [
        f"ModelRunnerOutput.{f}"
        for f in _MODEL_RUNNER_OUTPUT_FIELDS
        if f not in _field_names(ModelRunnerOutput)
    ]
    if missing:
        return None, "vLLM's scheduler lacks " + ", ".join(missing)
    return scheduler_cls, None


def _served_model_name(model_config: Any) -> str:
    name = getattr(model_config, "served_model_name", None) or getattr(
        model_config, "model", ""
    )
    if isinstance(name, (list, tuple)):
        name = name[0] if name else ""
    return str(name)[:MAX_MODEL_NAME_LEN]


def _is_async(scheduler: Any) -> bool:
    try:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    except ImportError:
        return False
    return isinstance(scheduler, AsyncScheduler)


def data_parallel_rank(parallel_config: Any) -> int:
    """The engine's DP rank. vLLM >= ~0.11 resets ``data_parallel_rank`` to 0
    in each independent (non-MoE) DP engine and keeps the real one in
    ``data_parallel_index``."""
    for field in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel_config, field, None)
        if isinstance(value, int):
            return value
    return 0


def engine_info(scheduler: Any) -> EngineInfo | None:
    """Describe a scheduler's engine, or None when it does not speculate."""
    vllm_config = scheduler.vllm_config
    spec = vllm_config.speculative_config
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    if k <= 0:
        return None
    parallel = vllm_config.parallel_config
    is_async = _is_async(scheduler)
    return EngineInfo(
        model=_served_model_name(vllm_config.model_config),
        method=str(getattr(spec, "method", None) or "unknown"),
        num_speculative_tokens=k,
        data_parallel_rank=data_parallel_rank(parallel),
        num_sampled_per_step=int(getattr(scheduler, "num_sampled_tokens_per_step", 1)),
        async_scheduling=is_async,
        steps_in_flight=int(is_async)
        + int(getattr(parallel, "pipeline_parallel_size", 1) or 1) - 1,
    )


def finished_status_threshold() -> int | None:
    """The status above which vLLM's ``RequestStatus.is_finished`` is true.

    Comparing ``request.status`` (an IntEnum) with an int is several times
    cheaper than calling ``request.is_finished()`` per request per step. The
    threshold is used only after checking it agrees with ``is_finished`` for
    every status; otherwise None (callers then call ``is_finished``).
    """
    try:
        from vllm.v1.request import RequestStatus

        threshold = int(RequestStatus.PREEMPTED)
        if all(RequestStatus.is_finished(s) == (s > threshold) for s in RequestStatus):
            return threshold
    except Exception:
        pass
    return None


def step_inputs(
    scheduler_output: Any, model_runner_output: Any
) -> tuple[Any, Any, Any, Any, Any, Any, Any, Any]:
    """The arguments of ``StepAccountant.observe_step`` for one call.

    Grammar-invalidated draft counts are absent before vLLM ~0.9. Requests
    whose external KV load failed are skipped, as vLLM does; vLLM also skips
    requests hit by invalid KV blocks, which needs the scheduler's block
    tables to tell, so those rare steps may count requests vLLM skipped
    (documented limitation).
    """
    f = STEP_FIELDS
    kv_output = getattr(model_runner_output, f.kv_output, None)
    failed = getattr(kv_output, f.kv_failed, None) if kv_output else None
    return (
        getattr(scheduler_output, f.spec_tokens),
        getattr(scheduler_output, f.num_scheduled),
        getattr(model_runner_output, f.sampled),
        getattr(model_runner_output, f.row_of),
        getattr(scheduler_output, f.invalid_spec_tokens, None),
        set(failed) if failed else None,
        getattr(model_runner_output, f.rows, None),
        getattr(scheduler_output, f.finished_ids, None),
    )


def finished_request_ids(obj: Any) -> Any:
    """``obj.finished_req_ids`` (a scheduler or a scheduler output), or None."""
    return getattr(obj, FINISHED_IDS_ATTR, None)


# The front end's manager of engine-core processes (API server, LLM): it
# stops them with SIGTERM and SIGKILLs those still alive after a timeout.
PROCESS_MANAGER_MODULE = "vllm.v1.engine.utils"
PROCESS_MANAGER_CLASS = "CoreEngineProcManager"


def process_manager_class() -> type | None:
    """``CoreEngineProcManager`` if it has the ``shutdown(timeout)`` we extend."""
    try:
        import importlib

        module = importlib.import_module(PROCESS_MANAGER_MODULE)
    except Exception:
        return None
    cls = getattr(module, PROCESS_MANAGER_CLASS, None)
    if cls is None or not has_method(cls, "shutdown") or not has_method(cls, "__init__"):
        return None
    return cls


def speculates(vllm_config: Any) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and int(getattr(spec, "num_speculative_tokens", 0) or 0) > 0
