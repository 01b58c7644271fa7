"""The export ledger between a front end and its engine processes, with real
processes (no vLLM): an engine that ended owing its final export is
reported once, one that settled or is still running is not."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time

import pytest

from otel_specdec import _export_ledger

LOST = "ended before its final metrics export had finished"


def _engine(settle: bool, linger_s: float) -> None:
    """An engine process's part: owe, then settle (or not), then linger."""
    _export_ledger.owe()
    if settle:
        _export_ledger.settle()
    time.sleep(linger_s)


def _start(settle: bool, linger_s: float) -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context("spawn").Process(
        target=_engine, args=(settle, linger_s), name=f"Engine-{settle}-{linger_s}")
    process.start()
    return process


@pytest.fixture
def ledger_folder():
    _export_ledger.open_for_engines()
    folder = _export_ledger._folder(os.getpid())
    yield folder
    for file in folder.glob("*"):
        file.unlink()
    if folder.exists():
        folder.rmdir()


def _owes(folder, process) -> bool:
    return (folder / str(process.pid)).exists()


def test_only_the_engine_that_ended_owing_is_reported(ledger_folder, caplog):
    killed = _start(settle=False, linger_s=60)
    settled = _start(settle=True, linger_s=0)
    running = _start(settle=False, linger_s=60)
    deadline = time.monotonic() + 30
    while not (_owes(ledger_folder, killed) and _owes(ledger_folder, running)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    settled.join(30)
    assert not _owes(ledger_folder, settled)
    killed.kill()  # what vLLM's process manager does past its timeout
    try:
        with caplog.at_level(logging.WARNING, logger="otel_specdec"):
            _export_ledger.report_unsettled([killed, settled, running], 20.0)
        lost = [r.getMessage() for r in caplog.records if LOST in r.getMessage()]
        assert len(lost) == 1 and f"pid {killed.pid}" in lost[0] and "20 s" in lost[0], lost
        # The running engine is left to the shutdown that waits for it.
        assert _owes(ledger_folder, running) and not _owes(ledger_folder, killed)
    finally:
        running.kill()
        running.join()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="otel_specdec"):
        _export_ledger.report_unsettled([running], None)
    assert [r.getMessage() for r in caplog.records if "vLLM's default 5 s" in r.getMessage()]
    assert not ledger_folder.exists()  # removed once nothing is owed


def test_an_engine_without_a_ledger_folder_writes_nothing(tmp_path, monkeypatch):
    """An engine whose parent made no folder (in-process, other launchers)."""
    monkeypatch.setattr(_export_ledger.tempfile, "gettempdir", lambda: str(tmp_path))
    _export_ledger.owe()
    _export_ledger.settle()
    assert list(tmp_path.iterdir()) == []
