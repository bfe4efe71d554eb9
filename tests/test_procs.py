"""migrate.procs, the one launcher: the ready line read from a pipe or a log file, and a child that
exits or stays silent reported with its output (a real gateway process: the quickest server to start)."""

from __future__ import annotations

import re

import httpx
import pytest
from relayout.migrate import procs


@pytest.mark.parametrize("to_log", [False, True])
def test_ready_url_then_stop(tmp_path, to_log):
    gw = procs.gateway("--replica", "http://127.0.0.1:9", "--port", "0", timeout=60,
                       log=tmp_path / "gw.log" if to_log else None)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", gw.url), gw.url
        assert httpx.get(f"{gw.url}/health", timeout=10).json()["status"] == "ok"
    finally:
        gw.stop()
    assert gw.poll() is not None


@pytest.mark.parametrize("to_log", [False, True])
def test_child_exiting_before_ready_is_reported(tmp_path, to_log):
    with pytest.raises(procs.LaunchError) as e:
        procs.gateway(timeout=60, log=tmp_path / "gw.log" if to_log else None)  # no --agent/--replica: exit 2
    assert e.value.exit_code == 2 and not e.value.timed_out
    assert "give at least one --agent or --replica" in e.value.output and "gateway exited with 2" in str(e.value)


def test_silent_child_is_stopped_at_the_timeout():
    never = re.compile(r"never printed (x)")
    p = procs.spawn(procs.GATEWAY_MODULE, "--replica", "http://127.0.0.1:9", "--port", "0", ready=never)
    with pytest.raises(procs.LaunchError) as e:
        p.wait_ready(3)
    assert e.value.timed_out and p.poll() is not None

