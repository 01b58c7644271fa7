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


def test_c_pass_checks_the_facts_it_shares_with_python():
    """The C pass is handed its field names by role, the count slots by name
    and the prune interval by value; a list that drifted from its own is
    refused at construction, not miscounted."""
    import pytest

    from otel_specdec import _accounting, _instruments
    from otel_specdec._totals import STEP_COUNTS, SpecDecodeTotals
    from otel_specdec._vllm_compat import STEP_FIELDS

    scanner = _accounting.NATIVE_SCANNER
    if scanner is None:
        pytest.skip("the C accelerator was not built")
    totals = SpecDecodeTotals({}, 3)

    def build(fields=None, counts=STEP_COUNTS, prune_every=8):
        fields = STEP_FIELDS._asdict() if fields is None else fields
        return scanner(totals, {}, _instruments.REQUEST_RATE_BOUNDS, fields, counts,
                       track_padding=True, in_flight=False, skip_finished=True,
                       finished_above=None, keep_steps=4, prune_every=prune_every,
                       sweep_every=4096)

    build()
    with pytest.raises(ValueError, match="count slot"):
        build(counts=tuple(reversed(STEP_COUNTS)))
    with pytest.raises(ValueError, match="fields expected|no field for role"):
        build(fields={**STEP_FIELDS._asdict(), "renamed": None})
    with pytest.raises(ValueError, match="no field for role"):
        fields = STEP_FIELDS._asdict()
        fields["other"] = fields.pop("rows")
        build(fields=fields)
    with pytest.raises(ValueError, match="prune_every"):
        build(prune_every=0)
