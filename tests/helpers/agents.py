"""Real agent processes for the tests: start, stop, wait for an operation, renice a replica."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
from relayout.engine.web import bearer_headers
from relayout.migrate import procs
from relayout.migrate.procs import stop_process

TOKEN = "agent-test-token"
H = bearer_headers(TOKEN)


def start_agent(data_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    ag = procs.agent("--port", "0", "--data-dir", str(data_dir), env={"RELAYOUT_TOKEN": TOKEN}, log=log, timeout=60)
    return ag.p, ag.url


def stop(p: subprocess.Popen) -> None:
    stop_process(p, 30)


def wait_op(agent: str, oid: str, timeout: float = 180) -> dict:
    end = time.monotonic() + timeout
    op: dict = {}
    while time.monotonic() < end:
        op = httpx.get(f"{agent}/v1/operations/{oid}", headers=H).json()
        if op["state"] in ("succeeded", "failed", "aborted"):
            return op
        time.sleep(0.2)
    raise AssertionError(f"operation {oid} did not finish: {op}")


def lower_priority(pid: int, niceness: int) -> None:
    """Renice `pid`: its scheduler autogroup (the agent starts each replica in a session of its own,
    and with autogroups enabled nice only weighs threads against their own group) and every thread
    (Linux nice is per thread; threads created later inherit it)."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(niceness))
    except OSError:
        pass  # no autogroups (or not allowed): the per-thread nice below is what counts then
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except (OSError, ValueError):
            pass
