"""Every patch the plugin applies, in one list (as vllm-ascend keeps its
``patch/`` folder): what it changes, why, how, what to watch upstream and
when it can go. The modules that apply them say the same next to the code;
``tests/test_patches.py`` checks that this list and what is installed agree.

A patch on vLLM is applied in every process where vLLM's plugin loader or
``opentelemetry-instrument`` activates the plugin, and removed by
``SpecDecodeInstrumentor().uninstrument()``. A patch on an OpenTelemetry or
``requests`` object touches only objects the plugin built itself.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PATCHES", "Patch"]


@dataclass(frozen=True)
class Patch:
    target: str  # what is changed: module.Class.method, or an object the plugin built
    module: str  # the plugin module that applies it
    why: str
    how: str
    watch: str  # upstream to watch
    removable_when: str


_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
_NO_HOOK = ("vLLM's stat loggers (vllm/v1/metrics/loggers.py, StatLoggerBase): "
            "no upstream issue filed yet")

PATCHES: tuple[Patch, ...] = (
    Patch(
        target=f"{_SCHEDULER}.__init__",
        module="otel_specdec._patch",
        why="attach a step accountant to each scheduler whose engine speculates",
        how="wrapt wrapper; after the host's __init__",
        watch=_NO_HOOK,
        removable_when="vLLM hands plugins per-step speculative data (a stat-logger or "
                       "scheduler hook that runs whatever disable_log_stats says)",
    ),
    Patch(
        target=f"{_SCHEDULER}.update_from_output",
        module="otel_specdec._patch",
        why="count drafts, accepted prefixes and per-position acceptance from the step's "
            "own inputs, exactly as vLLM's loop does, and release finished requests",
        how="replaced by a plain function (wrapt's dispatch alone costs more than the "
            "step budget); accounts before the host's update, releases after it; the "
            "original is kept in __wrapped__",
        watch=_NO_HOOK,
        removable_when="as for __init__",
    ),
    Patch(
        target=f"{_SCHEDULER}.finish_requests",
        module="otel_specdec._patch",
        why="record aborted requests' acceptance rates when the engine then goes idle",
        how="wrapt wrapper; after the host's",
        watch=_NO_HOOK,
        removable_when="as for __init__",
    ),
    Patch(
        target=f"{_SCHEDULER}.shutdown",
        module="otel_specdec._patch",
        why="export the last interval: engine processes started by fork end without "
            "exit hooks",
        how="wrapt wrapper; after the host's, bounded by OTEL_SPECDEC_SHUTDOWN_TIMEOUT",
        watch=_NO_HOOK,
        removable_when="vLLM gives plugins a shutdown hook in the engine-core process",
    ),
    Patch(
        target="vllm.v1.engine.core.EngineCore.shutdown",
        module="otel_specdec._shutdown_grace",
        why="export the last interval before the executor's teardown (a slow worker "
            "exit takes up to vLLM's worker grace + 4 s), which the front end's grace "
            "before its SIGKILL also pays for",
        how="wrapt wrapper; before the host's, the scheduler's shutdown export (which "
            "Scheduler.shutdown then skips)",
        watch="vLLM's EngineCore.shutdown (vllm/v1/engine/core.py)",
        removable_when="as for Scheduler.shutdown",
    ),
    Patch(
        target="vllm.v1.engine.core.EngineCoreProc.run_busy_loop",
        module="otel_specdec._signal_wake",
        why="a SIGTERM taken by a thread other than the main one (or just before the "
            "main one blocks) leaves vLLM's handler unrun while the idle main thread "
            "sleeps in input_queue.get(): the engine never reaches its shutdown path "
            "(and final export) and is SIGKILLed",
        how="wrapt wrapper; while the loop runs, a signal wakeup fd read by a daemon "
            "thread that puts vLLM's no-op WAKEUP request on the input queue on "
            "SIGTERM/SIGINT, so the main thread wakes and runs the pending handler",
        watch="vLLM's run_engine_core signal handling (vllm/v1/engine/core.py)",
        removable_when="vLLM wakes its busy loop from a signal taken by any thread",
    ),
    Patch(
        target="vllm.v1.engine.core.DPEngineCoreProc.run_busy_loop",
        module="otel_specdec._signal_wake",
        why="as for EngineCoreProc.run_busy_loop (the data-parallel loop overrides it)",
        how="as for EngineCoreProc.run_busy_loop",
        watch="as for EngineCoreProc.run_busy_loop",
        removable_when="as for EngineCoreProc.run_busy_loop",
    ),
    Patch(
        target="vllm.v1.engine.utils.CoreEngineProcManager.__init__, .shutdown",
        module="otel_specdec._shutdown_grace",
        why="vLLM SIGKILLs engine processes right after SIGTERM (shutdown_timeout 0), "
            "before their shutdown path can export the last interval",
        how="wrapt wrappers; for a speculating engine, shutdown waits up to vLLM's "
            "timeout + the shutdown budget + 5 s before the SIGKILL",
        watch="vLLM's engine shutdown (vllm/v1/engine/utils.py)",
        removable_when="vLLM gives engine processes a grace period after SIGTERM",
    ),
    Patch(
        target="MetricReader._receive_metrics of the readers on the plugin's provider",
        module="otel_specdec._metrics_export",
        why="the histograms are pre-aggregated from integer counts; the SDK has no "
            "public way to hand a reader finished histogram points",
        how="an instance attribute shadows the reader's method and adds the points "
            "to each collection (otel_specdec._sdk_compat)",
        watch="open-telemetry/opentelemetry-python: a public API for pre-aggregated "
              "histograms",
        removable_when="the SDK takes pre-aggregated histogram points",
    ),
    Patch(
        target="export of the metric exporters the plugin builds",
        module="otel_specdec._provider",
        why="tell at shutdown whether the final export was delivered, to warn of the "
            "data points the shutdown budget cut short",
        how="an instance attribute wraps export and records successes "
            "(DeliveryRecord.watch)",
        watch="open-telemetry/opentelemetry-python: a result from "
              "MeterProvider.force_flush/shutdown that says whether the export succeeded",
        removable_when="the SDK reports export results at shutdown",
    ),
    Patch(
        target="requests.Session of the OTLP/HTTP metric exporter the plugin builds",
        module="otel_specdec._http_session",
        why="REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE override the session's CA file "
            "(psf/requests#3829), so OTEL_EXPORTER_OTLP_CERTIFICATE is ignored",
        how="a Session subclass whose configured CA path wins over the environment's",
        watch="psf/requests#3829; the OTLP/HTTP exporter passing verify per request",
        removable_when="either of those changes",
    ),
)
