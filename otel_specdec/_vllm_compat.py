"""Everything that depends on vLLM's internals, in one place.

Patch target: ``vllm.v1.core.sched.scheduler.Scheduler`` (vLLM V1). The
plugin reads, and never writes, what ``HOST_FIELDS`` lists: each step's
inputs (``SchedulerOutput``, ``ModelRunnerOutput``, ``KVConnectorOutput``),
the scheduler's own state, and a few ``Request`` fields. The C pass reads
the step's inputs by the names in ``StepFields``, handed over by role.

Support is decided by structure, not by version: ``check_scheduler`` looks
for every field and method the plugin reads. A missing required one gives
one warning naming it, and the plugin stays inactive; a missing optional
one is a feature that release lacks (``None`` in the resolved
``StepFields``), and the accounting does what that release does without
it. Where releases count differently with the same fields, the difference
is in ``AccountingRules``, the one place that reads vLLM's version.
``docs/compatibility.md`` lists the releases and their differences.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import re
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

from otel_specdec._instruments import (
    ATTR_METHOD,
    ATTR_MODEL,
    ATTR_NUM_SPEC_TOKENS,
    MAX_MODEL_NAME_LEN,
)

__all__ = [
    "CURRENT_RULES",
    "ENGINE_BUSY_LOOP_CLASSES",
    "ENGINE_CORE_CLASS",
    "ENGINE_REQUEST_TYPE",
    "FINISHED_IDS_ATTR",
    "HOST_FIELDS",
    "OPTIONAL_METHODS",
    "PROCESS_MANAGER_CLASS",
    "PROCESS_MANAGER_FINALIZER_ATTR",
    "REQUIRED_METHODS",
    "SCHEDULER_MODULE",
    "STEP_FIELDS",
    "AccountingRules",
    "EngineInfo",
    "HostLayout",
    "StepFields",
    "check_scheduler",
    "data_parallel_rank",
    "engine_busy_loop_classes",
    "engine_core_class",
    "engine_info",
    "engine_wakeup_request",
    "finished_reason",
    "finished_request_ids",
    "finished_status_threshold",
    "has_method",
    "host_layout",
    "is_decoding",
    "process_manager_class",
    "process_manager_finalizer",
    "process_manager_processes",
    "process_manager_vllm_config",
    "speculates",
    "step_inputs",
    "takes_timeout",
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

    ``None`` (in ``host_layout().fields``): the running vLLM has no such
    field. The C pass (``_rowscan.Scanner``) takes them as a dict keyed by
    these role names, and ``step_inputs`` reads the same names.
    """

    # On SchedulerOutput.
    spec_tokens: str | None = "scheduled_spec_decode_tokens"
    num_scheduled: str | None = "num_scheduled_tokens"
    invalid_spec_tokens: str | None = "num_invalid_spec_tokens"  # optional
    finished_ids: str | None = FINISHED_IDS_ATTR  # optional
    # On ModelRunnerOutput.
    sampled: str | None = "sampled_token_ids"
    row_of: str | None = "req_id_to_index"  # optional: gone in 0.34 (rows are the index)
    rows: str | None = "req_ids"
    kv_output: str | None = "kv_connector_output"  # optional
    # On its KVConnectorOutput: requests whose external KV load failed.
    kv_failed: str | None = "failed_recving"  # optional
    # On Request: output of a step in flight when the request was preempted.
    stale_tokens: str | None = "num_stale_output_tokens"  # optional


STEP_FIELDS = StepFields()

# Every field and method the plugin reads: (owner, name, required). Owners
# are import paths; "Request" fields are instance attributes set in its
# __init__ or properties and methods.
_OUTPUT = "vllm.v1.core.sched.output.SchedulerOutput"
_RUNNER = "vllm.v1.outputs.ModelRunnerOutput"
_KV = "vllm.v1.outputs.KVConnectorOutput"
_REQUEST = "vllm.v1.request.Request"
_SCHEDULER = f"{SCHEDULER_MODULE}.{SCHEDULER_CLASS}"
HOST_FIELDS: tuple[tuple[str, str, bool], ...] = (
    (_OUTPUT, STEP_FIELDS.spec_tokens, True),
    (_OUTPUT, STEP_FIELDS.num_scheduled, True),
    (_OUTPUT, STEP_FIELDS.invalid_spec_tokens, False),
    (_OUTPUT, STEP_FIELDS.finished_ids, False),
    (_RUNNER, STEP_FIELDS.sampled, True),
    (_RUNNER, STEP_FIELDS.rows, True),
    (_RUNNER, STEP_FIELDS.row_of, False),
    (_RUNNER, STEP_FIELDS.kv_output, False),
    (_KV, STEP_FIELDS.kv_failed, False),
    (_SCHEDULER, "requests", True),
    (_SCHEDULER, "vllm_config", True),
    (_SCHEDULER, FINISHED_IDS_ATTR, False),
    (_SCHEDULER, "num_sampled_tokens_per_step", False),
    (_REQUEST, "request_id", True),
    (_REQUEST, "status", True),
    (_REQUEST, "is_finished", True),
    (_REQUEST, "num_output_tokens", True),
    (_REQUEST, STEP_FIELDS.stale_tokens, False),
    (_REQUEST, "drop_stale_output", False),
    (_REQUEST, "trace_headers", False),
    (_REQUEST, "get_finished_reason", False),
)
# Optional fields whose absence turns a feature off, and what the user loses.
_OPTIONAL_EFFECTS = {
    FINISHED_IDS_ATTR: "per-request acceptance rates are not recorded",
}


@dataclass(frozen=True)
class AccountingRules:
    """How this vLLM release counts, where releases differ with the same fields.

    ``skips_finished``: vLLM's loop skips a request that is finished but
    still in the scheduler's table (a KV-connector request whose blocks are
    freed later); before 0.16 only requests gone from the table were skipped.

    ``stale_drop_flag``: the ``Request`` flag that, with a nonzero
    ``StepFields.stale_tokens``, makes vLLM drop a request's in-flight
    output (0.27+: ``drop_stale_output``); None where the count alone does
    (0.25-0.26 skip drafts while ``async_tokens_to_discard`` is nonzero).
    """

    skips_finished: bool = True
    stale_drop_flag: str | None = "drop_stale_output"


# The rules of the newest releases.
CURRENT_RULES = AccountingRules()


@dataclass(frozen=True)
class HostLayout:
    """What the running vLLM offers the plugin, resolved once per process."""

    scheduler_cls: type
    fields: StepFields
    rules: AccountingRules
    version: str

    @property
    def fields_by_role(self) -> dict[str, str | None]:
        """The step fields keyed by role, as the C pass takes them."""
        return self.fields._asdict()


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
    """Declared fields (dataclass, msgspec struct or annotations) of ``cls``."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
        names.update(getattr(klass, "__struct_fields__", ()))
    return names


def _assigned_in_init(cls: type) -> set[str]:
    """Attribute names ``cls.__init__`` (and its bases') assign or read."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = inspect.unwrap(klass.__dict__.get("__init__", object.__init__))
        code = getattr(init, "__code__", None)
        if code is not None:
            names.update(code.co_names)
    return names


def _has_field(cls: type, name: str) -> bool:
    return (
        name in _field_names(cls)
        or hasattr(cls, name)
        or name in _assigned_in_init(cls)
    )


def has_method(cls: type, name: str) -> bool:
    """``cls`` implements ``name`` (an abstract one of its interface does not count)."""
    method = getattr(cls, name, None)
    return callable(method) and not getattr(method, "__isabstractmethod__", False)


def _import(path: str) -> Any:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "") or "")
    except Exception:
        return ""


def _release(version: str) -> tuple[int, int]:
    numbers = re.findall(r"\d+", version)
    return (int(numbers[0]), int(numbers[1])) if len(numbers) >= 2 else (10**6, 0)


# 0.25-0.26 skip the drafts of a request whose in-flight tokens are to be
# discarded (after a prefix-cache reset under async scheduling); the field
# exists from 0.22, but earlier releases count those drafts.
_DISCARD_TOKENS = "async_tokens_to_discard"
_DISCARD_RULE = ((0, 25), (0, 27))


def _resolve(version: str, absent: set[str], request_cls: Any) -> tuple[StepFields,
                                                                      AccountingRules]:
    """The step fields and counting rules of the running release.

    The rules that no field tells apart are read from the version (compared
    by minor release; a version that cannot be read counts as a newer
    release, whose rules are the current ones): see docs/compatibility.md.
    """
    release = _release(version)
    fields = StepFields(**{
        role: None if name in absent else name
        for role, name in STEP_FIELDS._asdict().items()
    })
    drop_flag: str | None = "drop_stale_output"
    if fields.stale_tokens is None or drop_flag in absent:
        fields, drop_flag = fields._replace(stale_tokens=None), None
        if (_DISCARD_RULE[0] <= release < _DISCARD_RULE[1]
                and _has_field(request_cls, _DISCARD_TOKENS)):
            fields = fields._replace(stale_tokens=_DISCARD_TOKENS)
    rules = AccountingRules(skips_finished=release >= (0, 16), stale_drop_flag=drop_flag)
    return fields, rules


_layout: HostLayout | None = None


def check_scheduler() -> tuple[type | None, str | None]:
    """Import the scheduler class and check every field the plugin reads.

    Returns ``(Scheduler, None)`` when supported, else ``(None, reason)``
    naming what is missing. On success the resolved layout is kept for
    ``host_layout``.
    """
    global _layout
    try:
        scheduler_cls = _import(_SCHEDULER)
    except Exception as exc:  # ImportError, or vLLM failing to import at all
        return None, f"vLLM V1 scheduler not importable ({type(exc).__name__}: {exc})"
    missing = [m for m in REQUIRED_METHODS if not has_method(scheduler_cls, m)]
    absent: set[str] = set()
    for owner, name, required in HOST_FIELDS:
        try:
            cls = _import(owner)
        except Exception:
            cls = None
        if cls is None or not _has_field(cls, name):
            if required:
                missing.append(f"{owner.rpartition('.')[2]}.{name}")
            else:
                absent.add(name)
    if missing:
        return None, "vLLM's scheduler lacks " + ", ".join(missing)
    version = _vllm_version()
    fields, rules = _resolve(version, absent, _import(_REQUEST))
    _layout = HostLayout(scheduler_cls, fields, rules, version)
    for name, effect in _OPTIONAL_EFFECTS.items():
        if name in absent:
            _logger.warning("otel_specdec: this vLLM has no %s; %s", name, effect)
    return scheduler_cls, None


def host_layout() -> HostLayout:
    """The layout ``check_scheduler`` resolved (resolving it if needed)."""
    if _layout is None:
        scheduler_cls, reason = check_scheduler()
        if scheduler_cls is None:
            raise RuntimeError(reason)
    assert _layout is not None
    return _layout


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


def finished_reason(status: Any) -> str | None:
    """The finish reason vLLM reports for a finished request's status, as text."""
    if status is None:
        return None
    try:
        reason = _finished_reason_of()(status)
    except Exception:
        return None
    return str(reason) if reason is not None else None


@functools.cache
def _finished_reason_of() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.get_finished_reason


def is_decoding(request: Any) -> bool:
    """A live, unfinished request that has output from earlier steps."""
    return request is not None and not request.is_finished() and bool(request.num_output_tokens)


def step_inputs(
    scheduler_output: Any, model_runner_output: Any, fields: StepFields
) -> tuple[Any, Any, Any, Any, Any, Any, Any]:
    """The arguments of ``StepAccountant.observe_step`` for one call.

    ``fields``: the running vLLM's (``host_layout().fields``); an absent
    optional field reads as empty. Without a batch index (vLLM 0.34+) the
    row order is the index, as vLLM's scheduler builds it. Requests whose
    external KV load failed are skipped, as vLLM does; vLLM also skips
    requests hit by invalid KV blocks, which needs the scheduler's block
    tables to tell, so those rare steps may count requests vLLM skipped
    (documented limitation).
    """
    f = fields
    kv_output = getattr(model_runner_output, f.kv_output, None) if f.kv_output else None
    failed = getattr(kv_output, f.kv_failed, None) if kv_output and f.kv_failed else None
    rows = getattr(model_runner_output, f.rows, None)
    row_of = getattr(model_runner_output, f.row_of) if f.row_of else None
    if row_of is None:
        row_of = {req_id: i for i, req_id in enumerate(rows or ())}
    return (
        getattr(scheduler_output, f.spec_tokens),
        getattr(scheduler_output, f.num_scheduled),
        getattr(model_runner_output, f.sampled),
        row_of,
        getattr(scheduler_output, f.invalid_spec_tokens, None) if f.invalid_spec_tokens else None,
        set(failed) if failed else None,
        getattr(scheduler_output, f.finished_ids, None) if f.finished_ids else None,
    )


def finished_request_ids(obj: Any) -> Any:
    """``obj.finished_req_ids`` (a scheduler or a scheduler output), or None."""
    return getattr(obj, FINISHED_IDS_ATTR, None)


# The engine core (in its own process, or in the front end's): its
# ``shutdown`` tears down the executor, then the scheduler.
ENGINE_CORE_CLASS = "vllm.v1.engine.core.EngineCore"


def engine_core_class() -> type | None:
    """``EngineCore``, whose ``shutdown`` tears the executor down before the scheduler."""
    try:
        cls = _import(ENGINE_CORE_CLASS)
    except Exception:
        return None
    return cls if has_method(cls, "shutdown") else None


# The engine-core process's busy loops (the data-parallel one overrides the
# other): each runs in the process's main thread until SIGTERM stops it.
ENGINE_BUSY_LOOP_CLASSES = ("vllm.v1.engine.core.EngineCoreProc",
                            "vllm.v1.engine.core.DPEngineCoreProc")
ENGINE_REQUEST_TYPE = "vllm.v1.engine.EngineCoreRequestType"


def engine_busy_loop_classes() -> list[type]:
    """Each class that defines its own ``run_busy_loop`` (none where vLLM has none)."""
    classes = []
    for path in ENGINE_BUSY_LOOP_CLASSES:
        try:
            cls = _import(path)
        except Exception:
            continue
        if callable(vars(cls).get("run_busy_loop")):
            classes.append(cls)
    return classes


def engine_wakeup_request() -> tuple[Any, Any] | None:
    """An input-queue item that wakes an idle busy loop and does nothing else:
    vLLM's ``WAKEUP`` where it has one, else an abort of no request."""
    try:
        request_type = _import(ENGINE_REQUEST_TYPE)
    except Exception:
        return None
    if hasattr(request_type, "WAKEUP"):
        return (request_type.WAKEUP, None)
    if hasattr(request_type, "ABORT"):
        return (request_type.ABORT, [])
    return None


# The front end's manager of engine-core processes (API server, LLM): it
# stops them with SIGTERM and SIGKILLs those still alive after a timeout.
PROCESS_MANAGER_MODULE = "vllm.v1.engine.utils"
PROCESS_MANAGER_CLASS = "CoreEngineProcManager"


def process_manager_class() -> type | None:
    """``CoreEngineProcManager`` if it has the ``shutdown(timeout)`` we extend."""
    try:
        cls = _import(f"{PROCESS_MANAGER_MODULE}.{PROCESS_MANAGER_CLASS}")
    except Exception:
        return None
    if not has_method(cls, "shutdown") or not has_method(cls, "__init__"):
        return None
    try:
        init_params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None
    if "vllm_config" not in init_params or not takes_timeout(cls.shutdown):
        return None
    return cls


# The manager's ``weakref.finalize`` that stops its processes when the
# manager is collected or the interpreter exits without ``shutdown`` (vLLM's
# 5 s default grace): ``shutdown(procs, timeout=None)``.
PROCESS_MANAGER_FINALIZER_ATTR = "_finalizer"


def process_manager_finalizer(manager: Any) -> Any:
    """The manager's live ``weakref.finalize``, or None."""
    finalizer = getattr(manager, "__dict__", {}).get(PROCESS_MANAGER_FINALIZER_ATTR)
    if isinstance(finalizer, weakref.finalize) and finalizer.alive:
        return finalizer
    return None


def process_manager_processes(manager: Any) -> list[Any]:
    """The engine-core processes (``multiprocessing`` processes) a manager started."""
    return list(getattr(manager, "processes", None) or ())


def takes_timeout(func: Any) -> bool:
    """Whether ``func`` (a process manager's shutdown) takes ``timeout``."""
    try:
        return "timeout" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def process_manager_vllm_config(init: Any, args: Any, kwargs: Any) -> Any:
    """The ``vllm_config`` argument of a ``CoreEngineProcManager.__init__`` call."""
    if "vllm_config" in kwargs:
        return kwargs["vllm_config"]
    try:
        bound = inspect.signature(init).bind_partial(*args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get("vllm_config")


def speculates(vllm_config: Any) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and int(getattr(spec, "num_speculative_tokens", 0) or 0) > 0
