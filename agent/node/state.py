"""The node agent's state: its registry of replicas, the replica processes it launched, and
the operations (checkpoint, restore, migrate, drain) it runs against them."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import Request
from relayout.agent.node.devices import node_devices, plan_devices
from relayout.agent.node.metrics import AgentMetrics
from relayout.agent.node.registry import Operation, Registry, ReplicaRecord
from relayout.agent.node.schema import OP_TIMEOUT, serve_flags
from relayout.engine import tracing, web
from relayout.engine.model.layout import Layout, LayoutError
from relayout.engine.web import HTTPError, tls_context
from relayout.migrate import procs
from relayout.migrate.procs import stop_process
from relayout.storage.settings import settings


def launch_timeout(engine: str = "builtin") -> float:
    """Seconds a launched replica has to print its URL: RELAYOUT_LAUNCH_TIMEOUT, else 180 (600 for
    vLLM, which loads and compiles for a minute or more first)."""
    return settings().launch_timeout or (600.0 if engine == "vllm" else 180.0)



def check_dtypes(dtype: str | None, kv_dtype: str | None) -> None:
    """A replica's dtype and KV dtype names, or HTTPError 400 naming the allowed values."""
    from relayout.engine.model.config import check_dtype, parse_kv_dtype

    try:
        check_dtype(dtype)
        parse_kv_dtype(kv_dtype)
    except ValueError as e:
        raise HTTPError(400, str(e)) from None


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child is not alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class Agent:
    def __init__(self, data_dir: Path, token: str | None, advertise_host: str):
        self.data_dir = Path(data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "checkpoints").mkdir(exist_ok=True)
        (self.data_dir / "replicas").mkdir(exist_ok=True)
        self.token = token
        self.host = advertise_host
        self.reg = Registry(self.data_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.busy: dict[str, str] = {}  # replica id -> operation id
        self.tasks: set[asyncio.Task] = set()
        self.draining = False
        self.drain_op: str | None = None
        self.agent_id = secrets.token_hex(8)  # tells a drain that its target is this very agent
        self.m = AgentMetrics()
        self.sessions_seen: dict[str, int] = {}
        self.devices = node_devices()  # the accelerators dealt to replicas (none on a CPU machine)

    # ---- helpers -----------------------------------------------------------------------------
    def headers(self) -> dict[str, str]:
        return web.bearer_headers(self.token)

    @staticmethod
    def client(timeout: float | httpx.Timeout) -> httpx.AsyncClient:
        """An HTTP client whose requests carry the current trace context (`traceparent`)."""
        return httpx.AsyncClient(verify=tls_context(), timeout=timeout, event_hooks=tracing.async_inject_hooks())

    def file_roots(self) -> list[str]:
        roots = [str(self.data_dir)]
        roots += [str(r) for r in settings().file_root_list()]
        return roots

    def startup(self) -> None:
        self.reg.load()
        for op in self.reg.operations.values():
            if op.live:
                op.state, op.error, op.finished_at = "failed", "agent restarted", time.time()
        for r in self.reg.replicas.values():
            if r.status == "running" and not (_pid_alive(r.pid) and self._answers(r.url)):
                r.status, r.exit_code = "dead", None
        self.reg.save()

    def _answers(self, url: str | None) -> bool:
        if not url:
            return False
        try:
            return httpx.get(f"{url}/health", timeout=3.0).status_code == 200
        except httpx.HTTPError:
            return False

    def refresh(self, rid: str) -> ReplicaRecord:
        r = self.reg.replicas[rid]
        if r.status != "running":
            return r
        p = self.procs.get(rid)
        code = p.poll() if p is not None else None
        if (p is not None and code is not None) or (p is None and not _pid_alive(r.pid)):
            r.status, r.exit_code = "dead", code
            self.reg.save()
        return r

    def get_replica(self, rid: str) -> ReplicaRecord:
        web.check_id(rid, "replica", 404)
        if rid not in self.reg.replicas:
            raise HTTPError(404, f"no replica {rid!r}")
        return self.refresh(rid)

    def running_replica(self, rid: str) -> ReplicaRecord:
        """The replica's record; 409 unless it is running."""
        r = self.get_replica(rid)
        if r.status != "running":
            raise HTTPError(409, f"replica {rid!r} is {r.status}")
        return r

    # ---- replicas ---------------------------------------------------------------------------
    async def launch(self, model: str, layout: str | None, name: str | None = None, dtype: str | None = None,
                     kv_dtype: str | None = None, engine: str = "builtin", vllm_args: list[str] | None = None,
                     attach: tuple[str, str] | None = None) -> dict:
        """Start a replica of `model` served by `engine` ("builtin" or "vllm", with `vllm_args` for
        vLLM's own server) and wait until it answers."""
        check_dtypes(dtype, kv_dtype)  # before any process starts
        rid = name or f"r-{secrets.token_hex(4)}"
        if rid in self.reg.replicas:
            raise HTTPError(409, f"replica {rid!r} already exists")
        log = self.data_dir / "replicas" / f"{rid}.log"
        try:
            world = Layout.parse(layout).world_size
        except LayoutError as e:
            raise HTTPError(400, str(e)) from None
        # an attached vLLM runs on devices its owner gave it: none are dealt
        dev = plan_devices([] if attach else self.devices, self.reg.replicas.values(), world, engine, vllm_args)
        env = {"RELAYOUT_DATA_DIR": str(self.data_dir), "RELAYOUT_FILE_ROOTS": os.pathsep.join(self.file_roots()),
               "RELAYOUT_TOKEN": self.token, **dev.env}  # None: the replica runs without one, whatever this env says
        args = [*(["--dtype", dtype] if dtype else []), *(["--kv-dtype", kv_dtype] if kv_dtype else []),
                *serve_flags(engine, [*(vllm_args or []), *dev.vllm_args], attach)]
        rec = self.reg.replicas[rid] = ReplicaRecord(rid, model, engine, layout, created_at=time.time(),
                                                     vllm_args=vllm_args or [], devices=dev.devices,
                                                     attach=attach[0] if attach else None)
        # its own session and a log file: the replica outlives an agent restart, which adopts it again
        proc = procs.replica(layout, env, model, args, host=self.host, log=log, new_session=True, wait=False)
        p = proc.p
        self.procs[rid] = p
        rec.pid = p.pid
        try:
            url = await asyncio.to_thread(proc.wait_ready, launch_timeout(engine))
        except procs.LaunchError as e:
            self.reg.replicas.pop(rid, None)
            self.procs.pop(rid, None)
            self.reg.save()
            raise HTTPError(504 if e.timed_out or p.returncode == -9 else 400,
                            f"replica did not start (exit {p.returncode}): {e.output.strip()[-400:]}",
                            code="launch_failed") from None
        lay = None
        try:
            async with self.client(10.0) as c:
                info = (await c.get(f"{url}/v1/replica", headers=self.headers())).json()
            lay = info.get("layout")
        except (httpx.HTTPError, ValueError):
            pass
        rec.status, rec.url, rec.layout = "running", url, lay or layout
        self.reg.save()
        return {"id": rid, "url": url, "layout": lay or layout, "engine": engine}

    async def describe(self, rid: str, timeout: float = 5.0) -> dict:
        r = self.get_replica(rid).view()  # with what the replica says now
        if r["status"] == "running":
            try:
                async with self.client(timeout) as c:
                    resp = await c.get(f"{r['url']}/v1/replica", headers=self.headers())
                if resp.status_code == 200:
                    info = resp.json()
                    r.update(layout=info.get("layout"), sessions=info.get("sessions", []),
                             kv_blocks_used=info.get("kv_blocks_used"), num_blocks=info.get("num_blocks"),
                             expert_balance=expert_balance(info.get("expert_counts")))
                    self.sessions_seen[rid] = len(r["sessions"])
                    self.m.observe_replica(rid, r.get("model", ""), info)
                else:
                    r["replica_error"] = f"replica answered {resp.status_code}"
            except (httpx.HTTPError, ValueError) as e:
                r["replica_error"] = f"replica unreachable: {type(e).__name__}"
        r.setdefault("sessions", [])
        return r

    def stop_replica(self, rid: str, timeout: float = 15.0) -> None:
        r = self.reg.replicas[rid]
        p = self.procs.pop(rid, None)
        pid = r.pid
        if p is not None:
            stop_process(p, timeout)
            r.exit_code = p.returncode
        elif _pid_alive(pid):
            try:
                os.kill(pid, signal.SIGTERM)
                end = time.monotonic() + timeout
                while _pid_alive(pid) and time.monotonic() < end:
                    time.sleep(0.1)
                if _pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        r.status = "stopped"
        self.sessions_seen.pop(rid, None)
        self.m.forget_replica(rid, r.model)

    def stop_all(self) -> None:
        for rid, r in list(self.reg.replicas.items()):
            if r.status in ("running", "starting"):
                self.stop_replica(rid)
        self.reg.save()

    # ---- operations -------------------------------------------------------------------------
    def new_op(self, kind: str, replica: str | None, work: Callable[[Operation], Awaitable[Any]]) -> str:
        if replica is not None:
            if replica in self.busy:
                raise HTTPError(409, f"replica {replica!r} is busy with operation {self.busy[replica]}")
        op = Operation(f"op-{secrets.token_hex(6)}", kind, replica)
        self.reg.operations[op.id] = op
        if replica is not None:
            self.busy[replica] = op.id
        self.reg.save()

        async def run():
            op.state = "running"
            self.m.running.labels(kind).inc()
            # the operation's trace: every request it makes carries it on (traceparent)
            with tracing.span(kind, operation=op.id, replica=replica) as sp:
                try:
                    op.result = await work(op)
                    op.state = "succeeded"
                except HTTPError as e:
                    op.state, op.error = "failed", e.message
                except asyncio.CancelledError:
                    op.state, op.error = "aborted", "cancelled"
                    raise
                except Exception as e:  # reported, never raised into the server
                    op.state, op.error = "failed", f"{type(e).__name__}: {e}"
                finally:
                    op.finished_at = time.time()
                    self.m.running.labels(kind).dec()
                    self.m.finished(kind, op.state, op.phase or "", op.finished_at - op.created_at, op.bytes_done or 0)
                    sp.set_attributes(tracing.attributes({"state": op.state, "bytes": op.bytes_done,
                                                          "failed_phase": op.phase if op.error else None}))
                    if op.error:
                        tracing.mark_error(sp, str(op.error))
                    op.phase = "done"
                    if replica is not None:
                        self.busy.pop(replica, None)
                    self.reg.save()

        t = asyncio.get_running_loop().create_task(run())
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return op.id

    async def replica_post(self, url: str, path: str, body: dict) -> dict:
        async with self.client(OP_TIMEOUT) as c:
            resp = await c.post(f"{url}{path}", json=body, headers=self.headers())
        if resp.status_code >= 400:
            raise HTTPError(resp.status_code if resp.status_code < 500 else 502,
                            f"replica {path} failed ({resp.status_code}): {web.error_message(resp)[:300]}")
        try:
            return resp.json()
        except ValueError:
            return {}


def expert_balance(counts: list[list[int]] | None) -> float | None:
    """How evenly a replica's tokens reach its experts: mean over max expert load in the most skewed
    layer (1.0: even; 0.25: one expert takes 4x its share). None before any token was routed."""
    worst = None
    for row in counts or []:
        if row and max(row) > 0:
            b = (sum(row) / len(row)) / max(row)
            worst = b if worst is None else min(worst, b)
    return None if worst is None else round(worst, 4)


async def agent_of(request: Request) -> Agent:
    """The agent behind a request (a dependency of every agent route): `create_agent_app` sets it."""
    # async: FastAPI runs a plain-def dependency on its thread pool, a thread hop per request
    return request.app.state.agent
