"""`relayout demo` (agent/commands/demo.py): the tour a new user runs. Its check is real (the streamed text against an
undisturbed run of the same request), the move happens mid-stream, and Ctrl-C leaves nothing running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def test_the_demo_moves_the_story_mid_stream_and_its_text_equals_an_undisturbed_run():
    from relayout.agent.commands.demo import run_demo

    shown: list[str] = []
    res = run_demo(shown.append, lambda m: None)
    assert not res.errors, res.errors
    assert res.moved_at is not None and 0 < res.moved_at < res.tokens  # the move came while it streamed
    assert res.stall_ms is not None and res.stall_ms > 0
    assert len(res.reference) > 100 and res.text == res.reference and res.identical
    marks = [p for p in shown if "moved to attn_dp=2,moe_ep=2" in p]
    assert len(marks) == 1 and "stall" in marks[0]
    assert "".join(p for p in shown if p not in marks) == "Once upon a time" + res.text


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_ctrl_c_stops_everything_the_demo_started():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "relayout.agent.cli", "demo", "--max-tokens", "4000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.read(len("Once upon a time")) == "Once upon a time"  # streaming now
        started = [c for c in _children_of(p.pid)]
        assert started, "the demo runs its parts as child processes"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 130, err[-2000:]
        assert "stopped" in err and "Traceback" not in err, err[-2000:]
        time.sleep(0.5)
        for c in started:
            assert not os.path.exists(f"/proc/{c}") or open(f"/proc/{c}/stat").read().split()[2] == "Z", c
    finally:
        if p.poll() is None:
            p.kill()
