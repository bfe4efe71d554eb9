"""Starting and stopping relayout processes, and looking at what they left behind: the one place
that launches a replica, agent, gateway or rank child and reads the URL it prints once ready.
Used by the agent, the re-layout controller, `relayout up`, the benches and the tests.

Every child is started through an entry point of the layer it belongs to: replicas with
`python -m relayout.migrate.replica.serve`, gateways with `python -m relayout.migrate.gateway.app`, agents
(and `relayout up`) with `python -m relayout.agent.cli`."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REPLICA_MODULE = "relayout.migrate.replica.serve"  # the replica server's entry point (flags as `relayout serve`)
GATEWAY_MODULE = "relayout.migrate.gateway.app"
CLI_MODULE = "relayout.agent.cli"  # agents (`agent`) and `relayout up`
RANK_MODULE = "relayout.engine.ranks.rank"  # one remote rank of a multi-host replica

# The line every relayout server prints once it is listening, e.g. "relayout serving builtin:tiny on
# http://127.0.0.1:8000", "relayout agent on http://...", "relayout gateway on http://..."; group 1 is its URL.
READY_RE = re.compile(r"relayout (?:serving .+?|agent|gateway) on (https?://\S+)")
# kept for callers that imported it: the ready-line pattern
URL_RE = READY_RE
TAIL_LINES = 400  # output lines a Proc keeps for error messages


class LaunchError(RuntimeError):
    """A child that exited or stayed silent before printing its ready line; `output` is its tail."""

    def __init__(self, message: str, exit_code: int | None, output: str, timed_out: bool = False):
        super().__init__(message)
        self.exit_code, self.output, self.timed_out = exit_code, output, timed_out


def stop_process(p: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM, wait up to `timeout`, then SIGKILL; always reaps."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _die_with_parent() -> None:
    """preexec: the child gets SIGTERM when its parent dies without cleaning up (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Proc:
    """A started child. `url` is set once it printed its ready line (`wait_ready`); its output goes to
    `log` (a file it keeps writing after this process is gone) or through a pipe read here (the last
    TAIL_LINES kept; after the ready line each one is also passed to `echo`)."""

    def __init__(self, p: subprocess.Popen, url: str = "", *, ready: re.Pattern[str] = READY_RE,
                 log: Path | None = None, log_offset: int = 0, what: str = "process",
                 echo: Callable[[str], None] | None = None, pump: bool = False):
        self.p, self.url, self.pid = p, url, p.pid
        self.ready, self.log, self.what, self.echo = ready, log, what, echo
        self.match: re.Match[str] | None = None  # the ready line's match (for patterns with more groups)
        self._log_offset = log_offset
        self._lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._seen = threading.Event()
        self._pump_thread: threading.Thread | None = None
        if pump and p.stdout is not None:  # only the Proc that started it reads its pipe
            self._pump_thread = threading.Thread(target=self._pump, name=f"{what}-output", daemon=True)
            self._pump_thread.start()

    def _pump(self) -> None:
        # reads until EOF so the child never blocks on a full pipe
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self._lines.append(line)
            if self.match is None:
                m = self.ready.search(line)
                if m:
                    self.match = m
                    self._seen.set()
            elif self.echo is not None:
                self.echo(line)
        self._seen.set()

    def output(self) -> str:
        """What the child printed so far (its log since the start, or the last TAIL_LINES lines)."""
        if self.log is not None:
            try:
                with open(self.log, errors="replace") as f:
                    f.seek(self._log_offset)
                    return f.read()
            except OSError:
                return ""
        return "".join(list(self._lines))

    def _find_ready(self) -> re.Match[str] | None:
        if self.log is None:
            return self.match
        text = self.output()
        m = self.ready.search(text[: text.rfind("\n") + 1])  # whole lines only: a URL may be half written
        self.match = m
        return m

    def wait_ready(self, timeout: float = 180.0) -> str:
        """Block until the ready line (returns the URL); LaunchError once the child exits first or
        `timeout` passes (the child is stopped then)."""
        end = time.monotonic() + timeout
        exited_at: float | None = None
        while True:
            m = self._find_ready()
            if m:
                self.url = m.group(1)
                return self.url
            if exited_at is None and self.p.poll() is not None:
                exited_at = time.monotonic()
            # exited: once its output is read to the end (a grandchild may hold the pipe: 2 s at most)
            if exited_at is not None and (self.log is not None or self._seen.is_set()
                                          or time.monotonic() - exited_at > 2.0):
                m = self._find_ready()  # a last look: the line may have come with the exit
                if m:
                    self.url = m.group(1)
                    return self.url
                out = self.output()
                raise LaunchError(f"{self.what} exited with {self.p.returncode}: {out[-2000:].strip()}",
                                  self.p.returncode, out)
            if time.monotonic() >= end:
                stop_process(self.p, 5)
                out = self.output()
                raise LaunchError(f"{self.what} did not print its URL within {timeout:g}s"
                                  + (f" (log: {self.log})" if self.log else f": {out[-2000:].strip()}"),
                                  self.p.returncode, out, timed_out=True)
            if self.log is None and not self._seen.is_set():
                self._seen.wait(min(0.1, max(0.0, end - time.monotonic())))
            else:
                time.sleep(0.05)

    def poll(self) -> int | None:
        return self.p.poll()

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once it exited (subprocess.TimeoutExpired after `timeout`); `output()` is then complete."""
        code = self.p.wait(timeout)
        if self._pump_thread is not None:
            self._pump_thread.join(5)  # a grandchild holding the pipe open must not hold this up
        return code

    def send_signal(self, sig: int) -> None:
        self.p.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, reaped."""
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()

    kill9 = kill

    @property
    def returncode(self) -> int | None:
        return self.p.returncode

    def children(self) -> list[int]:
        return children_of(self.pid)

    def stop(self, timeout: float = 15.0) -> None:
        stop_process(self.p, timeout)


# ---- starting ----------------------------------------------------------------------------------
def spawn(module: str, *args: str, env: Mapping[str, str | None] | None = None, ready: re.Pattern[str] = READY_RE,
          log: str | Path | None = None, new_session: bool = False, die_with_parent: bool = False,
          echo: Callable[[str], None] | None = None, cwd: str | None = None, capture: bool = True,
          what: str | None = None) -> Proc:
    """Start `python -m module *args` without waiting for it. `env` is laid over this process's
    environment (a None value removes a variable). Output: to `log` (appended; a child that must
    outlive this process), else through a pipe read by the Proc (`capture`), else inherited. `what`
    names the child in errors."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = v
    cmd = [sys.executable, "-m", module, *args]
    what = what or " ".join([module, *args[:1]])
    preexec = _die_with_parent if die_with_parent and sys.platform == "linux" else None
    common = dict(stdin=subprocess.DEVNULL, env=full_env, cwd=cwd, start_new_session=new_session,
                  preexec_fn=preexec)
    if log is not None:
        log = Path(log)
        with open(log, "ab") as out:
            offset = out.tell()
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **common)
        return Proc(p, ready=ready, log=log, log_offset=offset, what=what)
    if not capture:
        return Proc(subprocess.Popen(cmd, **common), ready=ready, what=what)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                         **common)
    return Proc(p, ready=ready, what=what, echo=echo, pump=True)


def start(module: str, *args: str, timeout: float = 180.0, wait: bool = True, **kw) -> Proc:
    """`spawn` (same keywords), then wait up to `timeout` s for its ready line: the Proc has its `url`.
    Raises LaunchError (the child stopped) when it exits or stays silent. `wait=False`: spawn only."""
    proc = spawn(module, *args, **kw)
    if wait:
        proc.wait_ready(timeout)
    return proc


def replica(layout: str | None = None, env: Mapping[str, str | None] | None = None, model: str = "builtin:tiny",
            args: Sequence[str] = (), *, host: str | None = None, port: int = 0, **kw) -> Proc:
    """A replica server (`--model`, `--port`, optional `--host`/`--layout`, then `args`); see `start`."""
    flags = ["--model", model, "--port", str(port), *(["--host", host] if host else []),
             *(["--layout", layout] if layout else []), *args]
    kw.setdefault("what", "replica")
    return start(REPLICA_MODULE, *flags, env=env, **kw)


def agent(*args: str, env: Mapping[str, str | None] | None = None, **kw) -> Proc:
    """A node agent: `relayout agent *args` (e.g. "--port", "0", "--data-dir", D); see `start`."""
    kw.setdefault("what", "agent")
    return start(CLI_MODULE, "agent", *args, env=env, **kw)


def gateway(*args: str, env: Mapping[str, str | None] | None = None, **kw) -> Proc:
    """A gateway: `python -m relayout.migrate.gateway.app *args` (e.g. "--agent", URL, "--port", "0")."""
    kw.setdefault("what", "gateway")
    return start(GATEWAY_MODULE, *args, env=env, **kw)


def rank(*args: str, env: Mapping[str, str | None] | None = None, **kw) -> Proc:
    """One remote rank of a multi-host replica (`python -m relayout.engine.ranks.rank *args`, torchrun-style `env`). It prints
    no URL: started without waiting (pass `wait=True` and a `ready` pattern to wait for a line)."""
    kw.setdefault("wait", False)
    kw.setdefault("what", "rank")
    return start(RANK_MODULE, *args, env=env, **kw)


def launch(*args: str, env: Mapping[str, str | None] | None = None, timeout: float = 180, **kw) -> Proc:
    """`relayout <command> *rest` as the right layer's entry point ("serve": replica, "gateway", "agent",
    else the CLI), ready to use."""
    cmd, rest = (args[0], args[1:]) if args else ("", ())
    kw.setdefault("cwd", ROOT)
    if cmd == "serve":
        return start(REPLICA_MODULE, *rest, env=env, timeout=timeout, what="replica", **kw)
    if cmd == "gateway":
        return start(GATEWAY_MODULE, *rest, env=env, timeout=timeout, what="gateway", **kw)
    return start(CLI_MODULE, *args, env=env, timeout=timeout, what=cmd or "relayout", **kw)


# ---- looking at processes ------------------------------------------------------------------------
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


def proc_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process `pid` has used so far (Linux /proc, clock ticks), None
    if it cannot be read (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class TreeCpu:
    """CPU seconds (user + system) this process and its descendants (a replica's rank processes)
    have used so far, cheap enough for a round's stall path: the descendants are listed once (a
    replica's ranks live as long as it does), this process is read through process_time
    (nanoseconds), the others through /proc (clock ticks, 10 ms here)."""

    def __init__(self) -> None:
        self._others: list[int] | None = None

    def __call__(self) -> float:
        if self._others is None:
            self._others = process_tree(os.getpid())[1:] if os.path.isdir("/proc") else []
        return time.process_time() + sum(proc_cpu_s(p) or 0.0 for p in self._others)


def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if alive(p):
            out.append(p)
            todo += children_of(p)
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process and every process under it, children first (kill -9 by default: as a lost node)."""
    for p in process_tree(pid)[::-1]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


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
