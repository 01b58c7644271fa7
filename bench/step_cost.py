"""(a) Step cost: vLLM's real ``Scheduler.update_from_output`` with and without
the plugin, side by side in one run, against vLLM's own statistics path.

For each batch size and k, a real vLLM scheduler (tiny model config) runs
steps with hand-made model outputs: every request's accepted prefix varies by
request and step over 0..k (full, partial and zero acceptance), requests
finish after 64 to 192 tokens and new ones arrive to keep the batch full, so
rows change owner and new requests prefill in the same steps, as in serving.

Two schedulers are fed identical streams, one with the plugin and one
running vLLM's unwrapped methods (``__wrapped__``); each step both run the
same step of their own stream, in ABBA order, so both see the same kinds of
steps under the same machine noise. After each plain step the anchor is
timed too: vLLM's own speculative-decoding statistics path for that
step's requests (``Scheduler.make_spec_decoding_stats`` per request, as its
loop calls it when stats logging is on, plus ``SpecDecodingProm.observe``,
its Prometheus side). Reported: medians per step; "added" is the median of
the per-step differences (the same step of both streams); each configuration
runs ``--rounds`` times on fresh schedulers (which of the two is built first
alternates by round) and the medians across rounds are printed, with each
round's mean added %. ``--control`` runs both schedulers without the plugin: its
"added" is the measurement's own noise floor. ``--versus-spans-off`` (with
``--tracing``) runs the plugin on both: the other scheduler's accountant is
built as with request spans off, so "added" is what spans add over the
plugin without them, paired step by step (issue 17, item 2), rather than
the difference of two runs' noisy "added"; with ``--control`` both run
it with spans off (the noise floor of that pairing).

``--own-time`` also times the plugin's own calls inside the hook (its C
step and its release after the update, through thin timing wrappers that
add a little to "added"): the part of "added" that is the plugin's code
itself, measured directly rather than as a difference of two noisy times.

What "added" covers: the whole hook (the accounting before the host's
update and the release after it), timed around ``update_from_output``.
Besides the median per step it prints the mean ("mean %": every step
counts, including the periodic pruning and the steps the median passes
over) and the whole step's mean with the schedule included ("step %": what
the plugin leaves behind shows in the next schedule). Both streams run the
same code around their update (vLLM's statistics path follows both), so
neither inherits the other's cache state; ``--net`` runs a control round
beside each round and subtracts its mean, the measurement's own bias.

    .venv/bin/python -m bench.step_cost [--batches 1,64,256,1024] [--ks 1,4,8] [--steps 300]
                                        [--rounds 5] [--tracing] [--control] [--net]
                                        [--pure-python] [--own-time]
                                        [--parents none|sampled|unsampled]
                                        [--versus-spans-off]

``--tracing`` turns request spans on (``OTEL_SPECDEC_TRACES=true``, spans
built on the plugin's worker thread and handed to an exporter that drops
them; ``OTEL_TRACES_SAMPLER`` picks the sampler, every span sampled by
default): the added time then includes keeping each request's detail and
handing finished requests over; the worker's own CPU time per step is
printed beside it.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _prometheus_side(scheduler: Any) -> Any:
    """vLLM's own Prometheus counters for speculative decoding, on a private registry."""
    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    class PrivateProm(SpecDecodingProm):
        _counter_cls = functools.partial(
            prometheus_client.Counter, registry=prometheus_client.CollectorRegistry()
        )

    return PrivateProm(scheduler.vllm_config.speculative_config, ["engine"], {0: ["0"]})


def _anchor_inputs(so: Any, mro: Any) -> list[tuple[int, int, str]]:
    """(drafted, accepted, req_id) for each request vLLM's stats path sees.

    From the step's own objects only: every scheduled request of this
    benchmark is live (none is aborted), and reading the scheduler's request
    table here would warm the caches for the update timed next to it.
    """
    out = []
    for req_id, drafts in so.scheduled_spec_decode_tokens.items():
        sampled = mro.sampled_token_ids[mro.req_id_to_index[req_id]]
        if drafts and sampled:
            out.append((len(drafts), len(sampled) - 1, req_id))
    return out


def _time_anchor(scheduler: Any, prom: Any, so: Any, items: list[tuple[int, int, str]]) -> float:
    invalid = getattr(so, "num_invalid_spec_tokens", None)
    scheduler.log_stats = True  # make_spec_decoding_stats is a no-op otherwise
    try:
        t0 = time.perf_counter()
        stats = None
        for drafted, accepted, req_id in items:
            stats = scheduler.make_spec_decoding_stats(stats, drafted, accepted, invalid, req_id)
        if stats is not None:
            prom.observe(stats)
        return time.perf_counter() - t0
    finally:
        scheduler.log_stats = False


def _parent_headers(sampled: bool) -> Any:
    """Each request's trace headers: a client's traceparent, sampled or not."""
    ids = iter(range(1, 1 << 60))
    flags = "01" if sampled else "00"
    return lambda _i: {"traceparent": f"00-{next(ids):032x}-00f067aa0ba902b7-{flags}"}


class _Stream:
    """One scheduler fed a deterministic stream of requests and model outputs."""

    def __init__(self, model_dir: str, batch: int, k: int, seed: int,
                 parents: str = "none") -> None:
        from tests.scheduler_harness import SchedulerHarness, build_scheduler

        self.harness = SchedulerHarness(build_scheduler(model_dir, k, log_stats=False,
                                                        max_num_seqs=max(batch, 1)))
        self.scheduler = self.harness.scheduler
        self.batch = batch
        self.rng = random.Random(seed)
        self.drafts = list(range(20, 20 + k))
        self.step_no = 0
        self.schedule_t = 0.0
        # The trace context requests arrive with (a client's traceparent).
        self.headers = None if parents == "none" else _parent_headers(parents == "sampled")
        self._so: Any = None

    def accept(self, req_id: str, d: list[int]) -> int:
        return (hash(req_id) + self.step_no) % (len(d) + 1)

    def propose(self, _req_id: str) -> list[int]:
        return self.drafts

    def next_step(self) -> tuple[Any, Any]:
        """Top the batch up, schedule, and make the model's output for it.

        The schedule is timed (``schedule_t``): the plugin patches nothing
        there, but whatever it leaves behind in the update (memory, caches)
        would show in the next schedule, so it is part of what it adds.
        """
        for _ in range(self.batch - len(self.scheduler.requests)):
            self.harness.add_requests(1, max_tokens=self.rng.randint(64, 192),
                                      trace_headers=self.headers)
        t0 = time.perf_counter()
        self._so = self.harness.schedule()
        self.schedule_t = time.perf_counter() - t0
        return self._so, self.harness.model_output(self._so, self.accept)

    def finish_step(self) -> None:
        self.harness.propose(self._so, self.propose)
        self.step_no += 1


def _without_spans(scheduler: Any) -> None:
    """Benchmark only: give ``scheduler`` the accountant the plugin builds
    with request spans off, in this process where they are on."""
    from otel_specdec import _runtime, _vllm_compat
    from otel_specdec._patch import _ACCOUNTANT_ATTR

    runtime = _runtime.current()
    assert runtime is not None and runtime.spans is not None, "request spans are off"
    spans, runtime.spans = runtime.spans, None
    try:
        accountant = runtime.accountant_for(scheduler, _vllm_compat.engine_info(scheduler))
    finally:
        runtime.spans = spans
    generation = scheduler.__dict__[_ACCOUNTANT_ATTR][0]
    scheduler.__dict__[_ACCOUNTANT_ATTR] = (generation, accountant)


def _time_own_calls(scheduler: Any, own_t: list[float]) -> None:
    """Time the plugin's own calls in the hook: its C step and its release."""
    from otel_specdec._patch import _ACCOUNTANT_ATTR

    accountant = scheduler.__dict__[_ACCOUNTANT_ATTR][1]
    calls = [accountant.step_fast, accountant.end_step]
    pending = [0.0]

    def timed(i: int) -> Any:
        call = calls[i]
        if call is None:
            return None

        def run(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*args)
            finally:
                pending[0] += time.perf_counter() - t0
                if i == 1:  # end_step (the release) ends the step
                    own_t.append(pending[0])
                    pending[0] = 0.0
        return run

    accountant.step_fast, accountant.end_step = timed(0), timed(1)


class _SpanWorkerClock:
    """CPU time of the plugin's span worker thread (request spans on).

    It builds spans off the scheduler's thread, but in one process: on a
    machine where the scheduler's thread is busy in Python it competes for
    the GIL, so its time is reported beside "added"."""

    def __init__(self) -> None:
        from otel_specdec import _runtime

        runtime = _runtime.current()
        self.emitter = runtime.spans if runtime is not None else None
        self.clock: int | None = None
        self.began = 0.0

    def start(self) -> None:
        # Not started where no span can be sampled (the plugin has no work for it).
        if self.emitter is not None and self.emitter._thread.ident is not None:
            self.clock = time.pthread_getcpuclockid(self.emitter._thread.ident)
            self.began = time.clock_gettime(self.clock)

    def stop(self) -> float:
        """Seconds of CPU since start, once what was handed over is built."""
        if self.clock is None or self.emitter is None:
            return 0.0
        from otel_specdec._bounded import Deadline

        self.emitter.flush(Deadline(30))
        return time.clock_gettime(self.clock) - self.began


def measure(model_dir: str, batch: int, k: int, steps: int, control: bool = False,
            plugin_first: bool = True, own_time: bool = False,
            parents: str = "none", versus_spans_off: bool = False) -> dict[str, float]:
    """Two schedulers fed identical streams: one with the plugin, one without
    (``versus_spans_off``: one with the plugin as with request spans off).

    Each step both run the same step of their own stream; which one runs
    first alternates (ABBA), so both see the same machine noise. The plain
    scheduler runs vLLM's unwrapped ``update_from_output``, so its time holds
    none of the plugin's work. ``plugin_first``: the plugin's scheduler is
    built first (the caller alternates it, so that neither side keeps the
    better memory layout).
    """
    seed = batch * 100 + k
    first, second = (_Stream(model_dir, batch, k, seed, parents),
                     _Stream(model_dir, batch, k, seed, parents))
    with_plugin, plain = (first, second) if plugin_first else (second, first)
    own_t: list[float] = []
    base_own_t: list[float] = []
    if versus_spans_off:
        _without_spans(plain.scheduler)
        if control:  # both with spans off: the paired measurement's noise floor
            _without_spans(with_plugin.scheduler)
    if own_time and not control:
        _time_own_calls(with_plugin.scheduler, own_t)
        if versus_spans_off:
            _time_own_calls(plain.scheduler, base_own_t)
    cls = type(plain.scheduler)
    original_update = cls.update_from_output.__wrapped__
    if versus_spans_off:  # the baseline runs the hook too, called as the plugin's side is
        def original_update(scheduler: Any, so: Any, mro: Any) -> Any:
            return scheduler.update_from_output(so, mro)
    prom = _prometheus_side(plain.scheduler)
    own_prom = _prometheus_side(with_plugin.scheduler)
    wrapped_t: list[float] = []
    plain_t: list[float] = []
    anchor_t: list[float] = []
    # Each timed step's schedule, (with plugin, plain).
    schedule_t: list[tuple[float, float]] = []

    # control: both streams unwrapped (versus_spans_off: both with spans off),
    # to show the measurement's own noise floor.
    update = (
        functools.partial(original_update, with_plugin.scheduler)
        if control or versus_spans_off else with_plugin.scheduler.update_from_output
    )

    def run_with_plugin(so: Any, mro: Any) -> None:
        t0 = time.perf_counter()
        update(so, mro)
        wrapped_t.append(time.perf_counter() - t0)
        # The same statistics work as after the plain update (its time is
        # not used): both sides then run identical code around the update,
        # so neither inherits the other's cache state (see the docstring).
        _time_anchor(with_plugin.scheduler, own_prom, so, _anchor_inputs(so, mro))

    def run_plain(so: Any, mro: Any) -> None:
        t0 = time.perf_counter()
        original_update(plain.scheduler, so, mro)
        plain_t.append(time.perf_counter() - t0)
        # After the update, as vLLM runs it inside its loop on warm data.
        anchor_t.append(_time_anchor(plain.scheduler, prom, so, _anchor_inputs(so, mro)))

    worker = _SpanWorkerClock()
    for step in range(steps + 3):
        if step == 3:
            worker.start()
        # Each stream's step is built right before it runs, so both run on
        # equally fresh objects.
        if step < 3:  # prefill and first drafts, untimed
            with_plugin.scheduler.update_from_output(*with_plugin.next_step())
            original_update(plain.scheduler, *plain.next_step())
        elif step % 4 in (0, 3):
            run_with_plugin(*with_plugin.next_step())
            run_plain(*plain.next_step())
        else:
            run_plain(*plain.next_step())
            run_with_plugin(*with_plugin.next_step())
        if step >= 3:
            schedule_t.append((with_plugin.schedule_t, plain.schedule_t))
        with_plugin.finish_step()
        plain.finish_step()
    worker_s = worker.stop()
    diffs = [w - p for w, p in zip(wrapped_t, plain_t, strict=True)]
    return {
        "plain": statistics.median(plain_t),
        "wrapped": statistics.median(wrapped_t),
        # The same step of both streams, run back to back: the difference
        # of each pair cancels what varies from step to step.
        "added": statistics.median(diffs),
        # Everything added over the run, per step: the mean counts the
        # steps the median passes over (periodic pruning, bursts of
        # finishing requests, the collector's pauses for what was allocated).
        "plain_mean": statistics.fmean(plain_t),
        "added_mean": statistics.fmean(diffs),
        # The whole step, schedule included: (schedule + update) differences.
        "step_added_mean": statistics.fmean(
            d + sw - sp for d, (sw, sp) in zip(diffs, schedule_t, strict=True)),
        "step_plain_mean": statistics.fmean(
            p + sp for p, (_, sp) in zip(plain_t, schedule_t, strict=True)),
        "anchor": statistics.median(anchor_t),
        # CPU time of the span worker thread per timed step (spans on).
        "worker": worker_s / steps,
        "own": statistics.median(own_t[3:]) if own_t[3:] else float("nan"),
        # The other side's own time (``versus_spans_off``), and the median of
        # the per-step differences.
        "base_own": statistics.median(base_own_t[3:]) if base_own_t[3:] else float("nan"),
        "own_added": (statistics.median(a - b for a, b in zip(own_t[3:], base_own_t[3:],
                                                              strict=True))
                      if base_own_t[3:] else float("nan")),
    }


def _discarding_tracer_provider() -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    os.environ["OTEL_SPECDEC_TRACES"] = "true"
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    return provider


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,64,256,1024")
    parser.add_argument("--ks", default="1,4,8")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5,
                        help="fresh schedulers per configuration; medians across rounds")
    parser.add_argument("--tracing", action="store_true", help="request spans on")
    parser.add_argument("--control", action="store_true",
                        help="both schedulers without the plugin: the noise floor")
    parser.add_argument("--pure-python", action="store_true",
                        help="the plugin without its C pass: every step on the exact "
                             "(per-request) path, as where the C pass was not built")
    parser.add_argument("--net", action="store_true",
                        help="also run a control round beside each round and subtract "
                             "its mean")
    parser.add_argument("--parents", choices=("none", "sampled", "unsampled"), default="none",
                        help="requests arrive with a client's traceparent, sampled or not")
    parser.add_argument("--own-time", action="store_true",
                        help="also time the plugin's own calls inside the hook")
    parser.add_argument("--versus-spans-off", action="store_true",
                        help="with --tracing: the other scheduler runs the plugin as with "
                             "request spans off (what spans add)")
    args = parser.parse_args()
    if args.versus_spans_off and not args.tracing:
        parser.error("--versus-spans-off needs --tracing")

    import logging

    logging.disable(logging.WARNING)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_specdec import SpecDecodeInstrumentor, _accounting
    from otel_specdec.demo.tiny_model import build_tiny_model

    if args.pure_python:
        _accounting.NATIVE_SCANNER = None

    model_dir = str(build_tiny_model(Path(tempfile.mkdtemp()) / "target"))
    SpecDecodeInstrumentor().instrument(
        meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]),
        tracer_provider=_discarding_tracer_provider() if args.tracing else None)
    accounting = ("exact path (pure Python)" if _accounting.NATIVE_SCANNER is None
                  else "C pass")
    sampler = os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    print(f"request spans: {f'on ({sampler})' if args.tracing else 'off'}; "
          f"parents: {args.parents}; accounting: {accounting}"
          f"{_control_note(args)}"
          f"{'; BASELINE: the plugin with spans off' if args.versus_spans_off else ''}")
    base = "baseline µs" if args.versus_spans_off else "unwrapped µs"
    print(f"{'batch':>6} {'k':>3} {base:>13} {'with plugin µs':>15} "
          f"{'added µs':>9} {'added %':>8} {'mean %':>7} {'step %':>7}"
          f"{' net %' if args.net else ''} {'vLLM stats µs':>14} {'added/vLLM':>11}  "
          "mean % per round")
    for batch in [int(b) for b in args.batches.split(",")]:
        for k in [int(x) for x in args.ks.split(",")]:
            rounds, controls = [], []
            for i in range(args.rounds):
                rounds.append(measure(model_dir, batch, k, args.steps, args.control,
                                      plugin_first=i % 2 == 0, own_time=args.own_time,
                                      parents=args.parents,
                                      versus_spans_off=args.versus_spans_off))
                if args.net:  # the noise floor, round by round beside the plugin's
                    controls.append(measure(model_dir, batch, k, args.steps, True,
                                            plugin_first=i % 2 == 1, parents=args.parents,
                                            versus_spans_off=args.versus_spans_off))
            print(_row(batch, k, rounds, controls, args.own_time), flush=True)


def _control_note(args: argparse.Namespace) -> str:
    if not args.control:
        return ""
    if args.versus_spans_off:
        return "; CONTROL: the plugin with spans off on both sides"
    return "; CONTROL: no plugin on either side"


def _row(batch: int, k: int, rounds: list[dict[str, float]], controls: list[dict[str, float]],
         own_time: bool) -> str:
    """One printed line: medians across rounds; mean-based shares of the mean step."""
    r = {key: statistics.median(x[key] for x in rounds) for key in rounds[0]}
    added = r["added"]
    mean_pct = [100 * x["added_mean"] / x["plain_mean"] for x in rounds]
    step_pct = statistics.median(
        100 * x["step_added_mean"] / x["step_plain_mean"] for x in rounds)
    line = (f"{batch:>6} {k:>3} {r['plain'] * 1e6:>13.1f} {r['wrapped'] * 1e6:>15.1f} "
            f"{added * 1e6:>9.1f} {100 * added / r['plain']:>7.1f}% "
            f"{statistics.median(mean_pct):>6.1f}% {step_pct:>6.1f}%")
    if controls:
        # The plugin's mean minus the control's (both unwrapped), summed
        # over rounds: what the plugin adds beyond the benchmark's own bias.
        net = sum(x["added_mean"] for x in rounds) - sum(c["added_mean"] for c in controls)
        line += f" {100 * net / sum(x['plain_mean'] for x in rounds):>5.1f}%"
    line += (f" {r['anchor'] * 1e6:>14.1f} {added / r['anchor']:>11.2f}  "
             + " ".join(f"{p:.1f}" for p in mean_pct))
    if own_time:
        line += f"  | own {r['own'] * 1e6:.1f} µs = {100 * r['own'] / r['plain']:.1f}%"
        if r["base_own"] == r["base_own"]:  # versus spans off
            line += (f" (spans off {r['base_own'] * 1e6:.1f} µs; paired difference "
                     f"{r['own_added'] * 1e6:+.1f} µs)")
    if r["worker"]:
        line += (f"  | span worker {r['worker'] * 1e6:.1f} µs/step = "
                 f"{100 * r['worker'] / r['plain_mean']:.1f}% (CPU, its own thread)")
    return line

if __name__ == "__main__":
    main()
