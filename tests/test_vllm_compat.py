"""What ``_vllm_compat`` decides from the structure of the running vLLM."""

from __future__ import annotations

import logging

from otel_specdec import SpecDecodeInstrumentor, _patch, _vllm_compat


def test_every_required_field_is_checked_and_named(reader, monkeypatch, caplog):
    # Take each required field or method away in turn (a release that renamed
    # it): one warning names it, and the plugin stays inactive.
    required = [(o, n) for o, n, req in _vllm_compat.HOST_FIELDS if req]
    assert len(required) >= 9
    SpecDecodeInstrumentor().uninstrument()
    try:
        for owner, name in required:
            real = _vllm_compat._has_field
            monkeypatch.setattr(
                _vllm_compat, "_has_field",
                lambda cls, field, o=owner, n=name, real=real:
                    False if (cls.__name__ == o.rpartition(".")[2] and field == n)
                    else real(cls, field),
            )
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                SpecDecodeInstrumentor().instrument()
            messages = [r.getMessage() for r in caplog.records
                        if r.name.startswith("otel_specdec")]
            assert len(messages) == 1, (name, messages)
            assert f"{owner.rpartition('.')[2]}.{name}" in messages[0]
            assert not _patch.is_installed()
            SpecDecodeInstrumentor().uninstrument()
            monkeypatch.undo()
    finally:
        monkeypatch.undo()
        SpecDecodeInstrumentor().instrument()


def test_fields_resolve_to_this_release():
    scheduler_cls, reason = _vllm_compat.check_scheduler()
    assert reason is None
    layout = _vllm_compat.host_layout()
    assert layout.scheduler_cls is scheduler_cls
    from vllm.v1.outputs import ModelRunnerOutput

    has_index = "req_id_to_index" in _vllm_compat._field_names(ModelRunnerOutput)
    assert (layout.fields.row_of is not None) == has_index
    # The C pass takes every role by name.
    assert set(layout.fields_by_role) == set(_vllm_compat.StepFields._fields)


def test_optional_field_absent_resolves_to_none(monkeypatch):
    real = _vllm_compat._has_field
    monkeypatch.setattr(_vllm_compat, "_has_field",
                        lambda cls, field: field != "req_id_to_index" and real(cls, field))
    scheduler_cls, reason = _vllm_compat.check_scheduler()
    assert scheduler_cls is not None, reason
    assert _vllm_compat.host_layout().fields.row_of is None
    monkeypatch.undo()
    _vllm_compat.check_scheduler()
