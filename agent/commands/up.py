"""`relayout up`: an agent, one replica and a gateway on this machine, stopped together."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import httpx
from relayout.agent.node.state import launch_timeout
from relayout.engine import web
from relayout.migrate import procs


def _start_child(start, *args: str, what: str, timeout: float = 120.0) -> procs.Proc:
    """A relayout server in its own process group, stopped with `relayout up` even if that dies without
    cleaning up; ready once it printed its URL, its later output forwarded to stderr."""
    return start(*args, new_session=True, die_with_parent=True, timeout=timeout,
                 echo=lambda line: sys.stderr.write(f"[{what}] {line}"))


def _stop_child(p: procs.Proc | None, timeout: float = 30.0) -> None:
    if p is not None:
        p.stop(timeout)


def run_up(host: str, port: int, agent_port: int, data_dir: Path, model: str = "builtin:tiny",
           layout: str | None = None, log=print, dtype: str | None = None, kv_dtype: str | None = None) -> int:
    """`relayout up`: the node agent on `agent_port`, one replica launched through it, the gateway on `port`
    in front (`--agent`). Prints `relayout up ready: gateway URL, agent URL`; SIGTERM/SIGINT stop all three.
    Returns the exit code (0 on a signal, 1 when a part failed)."""
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    hdr = web.bearer_headers(web.env_token())
    agent_p = gw_p = None
    agent_url = rid = None
    code = 0
    try:
        log(f"starting the agent on {host}:{agent_port} (data dir {data_dir})")
        agent_p = _start_child(procs.agent, "--host", host, "--port", str(agent_port), "--data-dir", str(data_dir),
                               what="agent")
        agent_url = agent_p.url
        log(f"launching a {model} replica through the agent")
        body: dict[str, Any] = {"model": model}
        if layout:
            body["layout"] = layout
        body.update({k: v for k, v in (("dtype", dtype), ("kv_dtype", kv_dtype)) if v})
        r = httpx.post(f"{agent_url}/v1/replicas", json=body, headers=hdr, timeout=launch_timeout() + 30)
        if r.status_code != 201:
            raise RuntimeError(f"the agent could not launch the replica ({r.status_code}): {web.error_message(r)}")
        rid = r.json()["id"]
        log(f"replica {rid} on {r.json()['url']}; starting the gateway on {host}:{port}")
        gw_p = _start_child(procs.gateway, "--agent", agent_url, "--host", host, "--port", str(port), what="gateway")
        print(f"relayout up ready: gateway {gw_p.url}, agent {agent_url}", flush=True)
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
