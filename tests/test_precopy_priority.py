"""Pre-copy workers (migrate.transport.base.background_thread) run at RELAYOUT_PRECOPY_NICE: a nice
value, or `idle` for SCHED_IDLE; only the calling thread is lowered, never its process."""

from __future__ import annotations

import os
import threading

import pytest
from relayout.migrate.transport.base import background_thread, precopy_nice
from relayout.storage.settings import SettingsError


def _in_worker(monkeypatch: pytest.MonkeyPatch, value: str) -> tuple[int, int]:
    monkeypatch.setenv("RELAYOUT_PRECOPY_NICE", value)
    got: dict = {}

    def run() -> None:
        background_thread()
        tid = threading.get_native_id()
        got["nice"], got["policy"] = os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    return got["nice"], got["policy"]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_nice_and_idle_lower_only_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), os.sched_getscheduler(0)
    assert _in_worker(monkeypatch, "10") == (max(10, mine[0]), os.SCHED_OTHER)
    assert _in_worker(monkeypatch, "idle")[1] == os.SCHED_IDLE
    assert (os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), os.sched_getscheduler(0)) == mine


def test_precopy_nice_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("idle", "idle"), (" IDLE ", "idle"), ("0", 0), ("25", 19), ("-3", 0)):
        monkeypatch.setenv("RELAYOUT_PRECOPY_NICE", raw)
        assert precopy_nice() == want, raw
    monkeypatch.setenv("RELAYOUT_PRECOPY_NICE", "x")  # refused, naming the variable (entry points check at start)
    with pytest.raises(SettingsError, match="RELAYOUT_PRECOPY_NICE"):
        precopy_nice()
    monkeypatch.delenv("RELAYOUT_PRECOPY_NICE")
    assert precopy_nice() == 10
