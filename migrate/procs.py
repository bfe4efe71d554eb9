"""Starting and stopping relayout processes, and looking at what they left behind: used by the
agent, the re-layout controller, the soak bench and the tests, so there is one way to do each."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

URL_RE = re.compile(r"(http://[\d.]+:\d+)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stop_process(p: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM, wait up to `timeout`, then SIGKILL; always reaps."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Proc:
    def __init__(self, p: subprocess.Popen, url: str):
        self.p, self.url, self.pid = p, url, p.pid

    def children(self) -> list[int]:
        return children_of(self.pid)

    def kill9(self) -> None:
        if self.p.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.p.wait(10)

    def stop(self) -> None:
        stop_process(self.p)


def children_of(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def rank_processes(pid: int) -> list[int]:
    """The rank processes (multiprocessing spawn children) of a replica's driver process."""
    out = []
    for c in children_of(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(c)
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def launch(*args: str, env: dict | None = None, timeout: float = 180) -> Proc:
    p = subprocess.Popen([sys.executable, "-m", "relayout.agent.cli", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    t0 = time.time()
    while time.time() - t0 < timeout:
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            raise RuntimeError(f"{args} exited with {p.returncode}")
        m = URL_RE.search(line)
        if m and ("serving" in line or "agent" in line or "gateway" in line):
            threading.Thread(target=p.stdout.read, daemon=True).start()  # keep the pipe drained
            return Proc(p, m.group(1))
    p.kill()
    raise RuntimeError(f"{args} did not start")


def replica(layout: str | None = None, env: dict | None = None, model: str = "builtin:tiny") -> Proc:
    args = ["serve", "--model", model, "--port", "0"] + (["--layout", layout] if layout else [])
    return launch(*args, env=env)


def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if alive(p):
            out.append(p)
            todo += children_of(p)
    return out


def usage(pid: int) -> dict:
    """RSS (MiB) and open file descriptors of a replica: its driver plus every descendant."""
    rss, fds, procs = 0, 0, process_tree(pid)
    for p in procs:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
    return {"rss_mb": round(rss / 1024, 1), "fds": fds, "processes": len(procs)}
