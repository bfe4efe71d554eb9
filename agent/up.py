"""`relayout up`: an agent, one replica and a gateway on this machine, stopped together."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from relayout.agent.node import LAUNCH_TIMEOUT, relayout_cmd
from relayout.migrate.procs import stop_process


def _die_with_parent() -> None:
    """preexec: the child gets SIGTERM if `relayout up` dies without cleaning up (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start_child(args: list[str], pattern: str, what: str, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start a relayout server in its own process group; wait for the URL line it prints once ready, then
    forward the rest of its output to stderr."""
    import threading

    p = subprocess.Popen(relayout_cmd() + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                         start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    rx = re.compile(pattern)
    lines: list[str] = []
    box: dict[str, str] = {}
    ready = threading.Event()

    def pump():
        assert p.stdout is not None
        for line in p.stdout:
            if not ready.is_set():
                lines.append(line)
                m = rx.search(line)
                if m:
                    box["url"] = m.group(1)
                    ready.set()
                continue
            sys.stderr.write(f"[{what}] {line}")
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    ready.wait(timeout)
    if "url" not in box:
        _stop_child(p)
        tail = "".join(lines)[-1500:].strip()
        raise RuntimeError(f"{what} did not start (exit {p.returncode}): {tail}")
    return p, box["url"]


def _stop_child(p: subprocess.Popen | None, timeout: float = 30.0) -> None:
    if p is not None:
        stop_process(p, timeout)


def run_up(host: str, port: int, agent_port: int, data_dir: Path, model: str = "builtin:tiny",
           layout: str | None = None, log=print, dtype: str | None = None, kv_dtype: str | None = None) -> int:
    """`relayout up`: the node agent on `agent_port`, one replica launched through it, the gateway on `port`
    in front (`--agent`). Prints `relayout up ready: gateway URL, agent URL`; SIGTERM/SIGINT stop all three.
    Returns the exit code (0 on a signal, 1 when a part failed)."""
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    token = os.environ.get("RELAYOUT_TOKEN") or None
    hdr = {"Authorization": f"Bearer {token}"} if token else {}
    agent_p = gw_p = None
    agent_url = rid = None
    code = 0
    try:
        log(f"starting the agent on {host}:{agent_port} (data dir {data_dir})")
        agent_p, agent_url = _start_child(["agent", "--host", host, "--port", str(agent_port), "--data-dir",
                                           str(data_dir)], r"relayout agent on (http://\S+)", "agent")
        log(f"launching a {model} replica through the agent")
        body: dict[str, Any] = {"model": model}
        if layout:
            body["layout"] = layout
        body.update({k: v for k, v in (("dtype", dtype), ("kv_dtype", kv_dtype)) if v})
        r = httpx.post(f"{agent_url}/v1/replicas", json=body, headers=hdr, timeout=LAUNCH_TIMEOUT + 30)
        if r.status_code != 201:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:500]
            raise RuntimeError(f"the agent could not launch the replica ({r.status_code}): {msg}")
        rid = r.json()["id"]
        log(f"replica {rid} on {r.json()['url']}; starting the gateway on {host}:{port}")
        gw_p, gw_url = _start_child(["gateway", "--agent", agent_url, "--host", host, "--port", str(port)],
                                    r"relayout gateway on (http://\S+)", "gateway")
        print(f"relayout up ready: gateway {gw_url}, agent {agent_url}", flush=True)
        while not stop.wait(0.5):
            for name, p in (("agent", agent_p), ("gateway", gw_p)):
                if p.poll() is not None:
                    log(f"the {name} exited ({p.returncode}); stopping")
                    code = 1
                    stop.set()
    except (RuntimeError, httpx.HTTPError) as e:
        if not stop.is_set():
            log(f"error: {e}")
            code = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        _stop_child(gw_p, 10)
        if rid and agent_p is not None and agent_p.poll() is None:
            try:  # removes it from the registry too (the agent would otherwise keep a stopped record)
                httpx.delete(f"{agent_url}/v1/replicas/{rid}", headers=hdr, timeout=30)
            except httpx.HTTPError:
                pass
        _stop_child(agent_p, 40)  # stops any other replica it launched
        log("stopped")
    return code
