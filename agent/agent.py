"""The node agent (SPEC §4): launches replicas on this node, runs checkpoint / restore /
migration operations against them, and lists its own checkpoint store.

`create_agent_app(data_dir, token)` builds the FastAPI app; `relayout agent` serves it."""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent.registry import Registry
from migrate.procs import stop_process

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
URL_RE = re.compile(r"relayout serving .* on (http://\S+)")
MAX_BODY = 1 << 20
LAUNCH_TIMEOUT = float(os.environ.get("RELAYOUT_LAUNCH_TIMEOUT", "180"))
OP_TIMEOUT = httpx.Timeout(600.0, connect=10.0)


class AgentError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.code = code or {400: "invalid_request", 401: "unauthorized", 404: "not_found", 409: "conflict",
                             413: "too_large", 422: "invalid_request", 501: "not_implemented",
                             502: "bad_gateway", 503: "unavailable"}.get(status, "error")


def _err(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def check_id(value: str, what: str) -> str:
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise AgentError(404, f"no {what} {value!r}")
    return value


# ---- request bodies ---------------------------------------------------------------------------
_STRICT = ConfigDict(extra="forbid")
IdStr = Field(pattern=ID_RE.pattern, max_length=128)


class ReplicaBody(BaseModel):
    model_config = _STRICT
    model: str = Field(..., min_length=1, max_length=1024)
    layout: str | dict[str, Any] | None = None
    name: str | None = Field(None, pattern=ID_RE.pattern, max_length=128)


class CheckpointBody(BaseModel):
    model_config = _STRICT
    destination: str | None = Field(None, max_length=4096)
    sessions: list[str] | None = Field(None, max_length=4096)
    stop: bool = False


class NewReplica(BaseModel):
    model_config = _STRICT
    model: str = Field(..., min_length=1, max_length=1024)
    layout: str | dict[str, Any] | None = None


class RestoreBody(BaseModel):
    model_config = _STRICT
    checkpoint: str = Field(..., min_length=1, max_length=4096)
    replica: str | NewReplica
    sessions: list[str] | None = Field(None, max_length=4096)


class MigrateTarget(BaseModel):
    model_config = _STRICT
    agent: str = Field(..., pattern=r"^https?://[^\s]+$", max_length=2048)
    replica: str | None = Field(None, pattern=ID_RE.pattern, max_length=128)
    layout: str | dict[str, Any] | None = None
    model: str | None = Field(None, max_length=1024)


class MigrateBody(BaseModel):
    model_config = _STRICT
    target: MigrateTarget
    sessions: list[str] | None = Field(None, max_length=4096)
    mode: Literal["live", "cold"] = "live"


class DrainBody(BaseModel):
    model_config = _STRICT
    target_agent: str = Field(..., pattern=r"^https?://[^\s]+$", max_length=2048)


def _check_session_ids(ids: list[str] | None) -> None:
    for s in ids or []:
        if not ID_RE.fullmatch(s):
            raise AgentError(400, f"invalid session id {s!r}")


def validate_layout(model: str, layout: str | dict | None) -> str | None:
    """Parse and check a layout against the model before anything is launched; 400 naming the field."""
    import json

    from engine.config import ModelConfig, ModelConfigError
    from engine.layout import Layout, LayoutError
    from engine.weights import ModelNotFoundError, resolve_model

    try:
        path = resolve_model(model)
    except (ModelNotFoundError, ValueError, OSError) as e:
        raise AgentError(400, f"model: {e}") from None
    try:
        cfg = ModelConfig.from_dir(path)
    except (ModelConfigError, ValueError, OSError) as e:
        raise AgentError(400, f"model: {e}") from None
    try:
        lay = Layout.parse(layout).validate(cfg)
    except (LayoutError, ValueError, TypeError) as e:
        raise AgentError(400, f"layout: {e}") from None
    if layout is None:
        return None
    return json.dumps(lay.to_dict()) if isinstance(layout, dict) else layout


def _relayout_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("relayout")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "from agent.cli import app; app()"]


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
        self.metrics = CollectorRegistry(auto_describe=True)
        self.m_ops = Counter("relayout_agent_operations", "Operations by kind and outcome", ["kind", "outcome"],
                             registry=self.metrics)
        self.m_bytes = Counter("relayout_agent_bytes_moved", "Checkpoint/transfer bytes moved", registry=self.metrics)
        self.m_replicas = Gauge("relayout_agent_replicas", "Replicas by status", ["status"], registry=self.metrics)
        self.m_sessions = Gauge("relayout_agent_sessions", "Live sessions on this node's replicas (last seen)",
                                registry=self.metrics)
        self.sessions_seen: dict[str, int] = {}

    # ---- helpers -----------------------------------------------------------------------------
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def file_roots(self) -> list[str]:
        roots = [str(self.data_dir)]
        extra = os.environ.get("RELAYOUT_FILE_ROOTS")
        if extra:
            roots += [r for r in extra.split(os.pathsep) if r]
        return roots

    def startup(self) -> None:
        self.reg.load()
        for op in self.reg.operations.values():
            if op.get("state") in ("pending", "running"):
                op.update(state="failed", error="agent restarted", finished_at=time.time())
        for r in self.reg.replicas.values():
            if r.get("status") == "running" and not (_pid_alive(r.get("pid")) and self._answers(r.get("url"))):
                r.update(status="dead", exit_code=None)
        self.reg.save()

    def _answers(self, url: str | None) -> bool:
        if not url:
            return False
        try:
            return httpx.get(f"{url}/health", timeout=3.0).status_code == 200
        except httpx.HTTPError:
            return False

    def refresh(self, rid: str) -> dict:
        r = self.reg.replicas[rid]
        if r.get("status") != "running":
            return r
        p = self.procs.get(rid)
        code = p.poll() if p is not None else None
        if (p is not None and code is not None) or (p is None and not _pid_alive(r.get("pid"))):
            r.update(status="dead", exit_code=code)
            self.reg.save()
        return r

    def get_replica(self, rid: str) -> dict:
        check_id(rid, "replica")
        if rid not in self.reg.replicas:
            raise AgentError(404, f"no replica {rid!r}")
        return self.refresh(rid)

    # ---- replicas ---------------------------------------------------------------------------
    async def launch(self, model: str, layout: str | None, name: str | None = None) -> dict:
        rid = name or f"r-{secrets.token_hex(4)}"
        if rid in self.reg.replicas:
            raise AgentError(409, f"replica {rid!r} already exists")
        log = self.data_dir / "replicas" / f"{rid}.log"
        cmd = _relayout_cmd() + ["serve", "--model", model, "--host", self.host, "--port", "0"]
        if layout:
            cmd += ["--layout", layout]
        env = dict(os.environ, RELAYOUT_DATA_DIR=str(self.data_dir), RELAYOUT_FILE_ROOTS=os.pathsep.join(self.file_roots()))
        if self.token:
            env["RELAYOUT_TOKEN"] = self.token
        else:
            env.pop("RELAYOUT_TOKEN", None)
        self.reg.replicas[rid] = {"id": rid, "model": model, "layout": layout, "status": "starting", "pid": None,
                                  "url": None, "created_at": time.time()}
        with open(log, "wb") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True)
        self.procs[rid] = p
        self.reg.replicas[rid]["pid"] = p.pid
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        url = None
        while time.monotonic() < deadline:
            m = URL_RE.search(log.read_text(errors="replace"))
            if m:
                url = m.group(1)
                break
            if p.poll() is not None:
                break
            await asyncio.sleep(0.1)
        if url is None:
            tail = log.read_text(errors="replace")[-800:]
            if p.poll() is None:
                p.kill()
                p.wait()
            self.reg.replicas.pop(rid, None)
            self.procs.pop(rid, None)
            self.reg.save()
            raise AgentError(400 if p.returncode not in (None, -9) else 504,
                             f"replica did not start (exit {p.returncode}): {tail.strip()[-400:]}", "launch_failed")
        lay = None
        try:
            async with httpx.AsyncClient(timeout=10.0) as c:
                info = (await c.get(f"{url}/v1/replica", headers=self.headers())).json()
            lay = info.get("layout")
        except (httpx.HTTPError, ValueError):
            pass
        self.reg.replicas[rid].update(status="running", url=url, layout=lay or layout)
        self.reg.save()
        return {"id": rid, "url": url, "layout": lay or layout}

    async def describe(self, rid: str) -> dict:
        r = dict(self.get_replica(rid))
        if r["status"] == "running":
            try:
                async with httpx.AsyncClient(timeout=5.0) as c:
                    resp = await c.get(f"{r['url']}/v1/replica", headers=self.headers())
                if resp.status_code == 200:
                    info = resp.json()
                    r.update(layout=info.get("layout"), sessions=info.get("sessions", []),
                             kv_blocks_used=info.get("kv_blocks_used"), num_blocks=info.get("num_blocks"))
                    self.sessions_seen[rid] = len(r["sessions"])
                else:
                    r["replica_error"] = f"replica answered {resp.status_code}"
            except (httpx.HTTPError, ValueError) as e:
                r["replica_error"] = f"replica unreachable: {type(e).__name__}"
        r.setdefault("sessions", [])
        return r

    def stop_replica(self, rid: str, timeout: float = 15.0) -> None:
        r = self.reg.replicas[rid]
        p = self.procs.pop(rid, None)
        pid = r.get("pid")
        if p is not None:
            _stop_child(p, timeout)
            r["exit_code"] = p.returncode
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
        r["status"] = "stopped"
        self.sessions_seen.pop(rid, None)

    def stop_all(self) -> None:
        for rid, r in list(self.reg.replicas.items()):
            if r.get("status") in ("running", "starting"):
                self.stop_replica(rid)
        self.reg.save()

    # ---- operations -------------------------------------------------------------------------
    def new_op(self, kind: str, replica: str | None, work) -> str:
        if replica is not None:
            if replica in self.busy:
                raise AgentError(409, f"replica {replica!r} is busy with operation {self.busy[replica]}")
        oid = f"op-{secrets.token_hex(6)}"
        op = {"id": oid, "kind": kind, "replica": replica, "state": "pending", "phase": "queued", "bytes_done": 0,
              "bytes_total": None, "stall_ms": None, "error": None, "result": None, "created_at": time.time()}
        self.reg.operations[oid] = op
        if replica is not None:
            self.busy[replica] = oid
        self.reg.save()

        async def run():
            op.update(state="running")
            try:
                op["result"] = await work(op)
                op["state"] = "succeeded"
            except AgentError as e:
                op.update(state="failed", error=e.message)
            except asyncio.CancelledError:
                op.update(state="aborted", error="cancelled")
                raise
            except Exception as e:  # reported, never raised into the server
                op.update(state="failed", error=f"{type(e).__name__}: {e}")
            finally:
                op["finished_at"] = time.time()
                op["phase"] = "done"
                self.m_ops.labels(kind, op["state"]).inc()
                if op.get("bytes_done"):
                    self.m_bytes.inc(op["bytes_done"])
                if replica is not None:
                    self.busy.pop(replica, None)
                self.reg.save()

        t = asyncio.get_running_loop().create_task(run())
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return oid

    async def replica_post(self, url: str, path: str, body: dict) -> dict:
        async with httpx.AsyncClient(timeout=OP_TIMEOUT) as c:
            resp = await c.post(f"{url}{path}", json=body, headers=self.headers())
        try:
            data = resp.json()
        except ValueError:
            data = {}
        if resp.status_code >= 400:
            msg = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
            raise AgentError(resp.status_code if resp.status_code < 500 else 502,
                             f"replica {path} failed ({resp.status_code}): {msg or resp.text[:300]}")
        return data


DRAIN_PASSES = 8  # re-list and retry: sessions that finish or arrive while a replica is moved


async def drain_node(ag: Agent, op: dict, target: str) -> dict:
    """Move every session of every replica on this node to new replicas (same model and layout) on
    `target`. Progress per replica is in op["result"] while it runs; a session that cannot be moved
    is listed in `sessions_not_moved` (the op then fails), never dropped silently."""
    from migrate.live import MigrationError, migrate_live

    res: dict[str, Any] = {"target_agent": target, "replicas": [], "sessions_moved": 0, "sessions_not_moved": []}
    op["result"] = res
    rids = [rid for rid in list(ag.reg.replicas) if ag.refresh(rid).get("status") == "running"]
    entries = {rid: {"replica": rid, "state": "pending", "target_replica": None, "target_url": None,
                     "sessions_moved": [], "sessions_finished_here": [], "sessions_not_moved": [], "error": None,
                     "bytes_done": 0, "launch_s": None, "move_s": None}
               for rid in rids}
    live_at_start: dict[str, set[str]] = {rid: set() for rid in rids}
    res["replicas"] = list(entries.values())
    for rid, r in ag.reg.replicas.items():
        if rid not in entries and r.get("status") in ("dead", "starting"):
            res["replicas"].append({"replica": rid, "state": "skipped", "error": f"replica is {r.get('status')}"})

    async def sessions_of(url: str) -> list[str]:
        async with httpx.AsyncClient(timeout=30.0) as c:
            info = (await c.get(f"{url}/v1/replica", headers=ag.headers())).json()
        return [s["id"] for s in info.get("sessions", [])]

    async def session_state(url: str, sid: str) -> str:
        try:
            async with httpx.AsyncClient(timeout=10.0) as c:
                return (await c.get(f"{url}/v1/sessions/{sid}", headers=ag.headers())).json().get("state", "unknown")
        except (httpx.HTTPError, ValueError):
            return "unknown"

    async def wait_not_busy(rid: str) -> None:
        end = time.monotonic() + 300
        while rid in ag.busy and time.monotonic() < end:
            await asyncio.sleep(0.2)
        if rid in ag.busy:
            raise AgentError(409, f"replica {rid} stayed busy with operation {ag.busy[rid]}")

    async def launch_target(rid: str) -> None:
        e, r = entries[rid], ag.reg.replicas[rid]
        e["state"] = "launching"
        async with httpx.AsyncClient(timeout=OP_TIMEOUT) as c:
            resp = await c.post(f"{target}/v1/replicas", headers=ag.headers(),
                                json={"model": r["model"], "layout": r.get("layout")})
        if resp.status_code >= 400:
            raise AgentError(502, f"target agent refused the replica ({resp.status_code}): {resp.text[:300]}")
        tr = resp.json()
        e.update(target_replica=tr["id"], target_url=tr["url"], state="launched")

    async def move(rid: str) -> None:
        e, src = entries[rid], ag.reg.replicas[rid]["url"]
        e["state"] = "migrating"
        op["phase"] = f"migrating {rid}"
        failed: dict[str, str] = {}  # sessions given up on (a move of them alone failed), with the reason
        last_err: dict[str, str] = {}
        strikes = 0
        seen = live_at_start[rid]  # so a session that finishes here before its turn is still accounted for
        for _ in range(DRAIN_PASSES):
            ids = [s for s in await sessions_of(src) if s not in failed]
            seen.update(ids)
            if not ids:
                break
            # all at once; after two failed tries one by one, so one bad session cannot hold back the rest
            for group in ([ids] if strikes < 2 else [[s] for s in ids]):
                base = e["bytes_done"]

                def progress(phase=None, nbytes=None, *_, _base=base, **__):
                    if phase is not None:
                        op["phase"] = f"{rid}: {phase}"
                    if nbytes is not None:
                        e["bytes_done"] = _base + nbytes
                        op["bytes_done"] = sum(x["bytes_done"] for x in entries.values())

                try:
                    mr = await asyncio.to_thread(migrate_live, src, e["target_url"], group, token=ag.token,
                                                 mode="live", progress=progress)
                except MigrationError as err:
                    if err.committed_sessions:  # failed after the commit: they live on the target now
                        e["sessions_moved"] += [s for s in err.committed_sessions if s not in e["sessions_moved"]]
                    # often a session finished between the pre-copy and the cutover: the next pass lists again
                    for sid in group:
                        last_err[sid] = str(err)
                    if len(group) == 1:
                        failed[group[0]] = str(err)
                    else:
                        strikes += 1
                    continue
                e["bytes_done"] = base + mr.bytes_total
                op["bytes_done"] = sum(x["bytes_done"] for x in entries.values())
                op["stall_ms"] = max(op.get("stall_ms") or 0.0, mr.stall_ms)
                e["sessions_moved"] += [s for s in mr.sessions if s not in e["sessions_moved"]]
                for sid in group:
                    if sid not in mr.sessions and sid not in e["sessions_finished_here"]:
                        if await session_state(src, sid) == "finished":
                            e["sessions_finished_here"].append(sid)
        left = [s for s in await sessions_of(src)]
        # the source's own word settles any session the migration results did not name (e.g. a
        # move whose answer was lost after its commit): released to the target, or finished here
        for sid in sorted(seen - set(left) - set(e["sessions_moved"]) - set(e["sessions_finished_here"])):
            state = await session_state(src, sid)
            if state == "migrated":
                e["sessions_moved"].append(sid)
            elif state == "finished":
                e["sessions_finished_here"].append(sid)
            else:
                e["sessions_not_moved"].append({"id": sid, "error": f"not on the source any more (state {state})"})
        for sid in left:
            why = failed.get(sid) or last_err.get(sid) or f"still on the source after {DRAIN_PASSES} passes"
            e["sessions_not_moved"].append({"id": sid, "error": why})
        e["state"] = "failed" if left or e["sessions_not_moved"] else "drained"

    async def drain_replica(rid: str) -> None:
        # each replica moves as soon as its own target is up: sessions keep decoding on the source
        # meanwhile, and a later replica's sessions do not wait behind an earlier one's move
        e = entries[rid]
        t0 = time.monotonic()
        try:
            await launch_target(rid)
            e["launch_s"] = round(time.monotonic() - t0, 2)
            await wait_not_busy(rid)
        except AgentError as err:
            e.update(state="failed", error=err.message)
            return
        except (httpx.HTTPError, ValueError, KeyError) as err:
            e.update(state="failed", error=f"{type(err).__name__}: {err}")
            return
        ag.busy[rid] = op["id"]
        t0 = time.monotonic()
        try:
            await move(rid)
        except (httpx.HTTPError, ValueError, KeyError) as err:
            e.update(state="failed", error=f"{type(err).__name__}: {err}")
        finally:
            ag.busy.pop(rid, None)
            e["move_s"] = round(time.monotonic() - t0, 2)

    try:
        for rid in rids:  # what was live when the drain began: every one of these ends up named in the result
            try:
                live_at_start[rid] = set(await sessions_of(ag.reg.replicas[rid]["url"]))
            except (httpx.HTTPError, ValueError):
                pass  # move() lists again; an unreachable replica fails there with the reason
        op["phase"] = "launching target replicas"
        await asyncio.gather(*(drain_replica(rid) for rid in rids))
        # replicas that failed before moving anything: their live sessions are reported too
        for rid in rids:
            e = entries[rid]
            if e["state"] == "failed" and not e["sessions_not_moved"]:
                try:
                    left = await sessions_of(ag.reg.replicas[rid]["url"])
                except (httpx.HTTPError, ValueError):
                    left = []
                e["sessions_not_moved"] = [{"id": s, "error": e["error"]} for s in left]
    finally:
        res["sessions_moved"] = sum(len(e["sessions_moved"]) for e in entries.values())
        res["sessions_not_moved"] = [s for e in entries.values() for s in e["sessions_not_moved"]]
        res["sessions"] = [s for e in entries.values() for s in e["sessions_moved"]]
        ag.reg.save()
    bad = [e for e in entries.values() if e["state"] == "failed"]
    if bad:
        raise AgentError(502, f"drain incomplete: {len(res['sessions_not_moved'])} session(s) not moved, "
                              f"replica(s) {', '.join(e['replica'] for e in bad)} failed; see result")
    op["phase"] = "drained"
    return res


def create_agent_app(data_dir: Path, token: str | None, advertise_host: str = "127.0.0.1") -> FastAPI:
    ag = Agent(Path(data_dir), token or None, advertise_host)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(ag.startup)
        try:
            yield
        finally:
            for t in list(ag.tasks):
                t.cancel()
            await asyncio.to_thread(ag.stop_all)

    app = FastAPI(title="relayout agent", version="1", lifespan=lifespan)
    app.state.agent = ag

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                if int(cl) > MAX_BODY:
                    return _err(413, "too_large", f"request body over {MAX_BODY} bytes")
            except ValueError:
                return _err(400, "invalid_request", "bad content-length")
        elif request.method in ("POST", "PUT", "PATCH"):
            body = b""
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY:
                    return _err(413, "too_large", f"request body over {MAX_BODY} bytes")
            request._body = body  # type: ignore[attr-defined]
        return await call_next(request)

    @app.exception_handler(AgentError)
    async def _agent_error(_: Request, e: AgentError):
        return _err(e.status, e.code, e.message)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        parts = []
        for d in e.errors()[:5]:
            loc = ".".join(str(x) for x in d.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {d.get('msg')}")
        return _err(422, "invalid_request", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return _err(e.status_code, "not_found" if e.status_code == 404 else "invalid_request", str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        return _err(500, "internal", f"internal error: {type(e).__name__}")

    def auth(request: Request) -> None:
        if ag.token is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {ag.token}".encode()):
            raise AgentError(401, "missing or wrong bearer token")

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "draining": ag.draining, "agent_id": ag.agent_id}

    @app.get("/metrics")
    async def metrics():
        counts: dict[str, int] = {}
        for rid in list(ag.reg.replicas):
            st = ag.refresh(rid).get("status", "unknown")
            counts[st] = counts.get(st, 0) + 1
        for st in ("running", "dead", "stopped", "starting"):
            ag.m_replicas.labels(st).set(counts.get(st, 0))
        ag.m_sessions.set(sum(ag.sessions_seen.values()))
        return PlainTextResponse(generate_latest(ag.metrics).decode(), media_type="text/plain; version=0.0.4")

    from fastapi import APIRouter

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth)])

    # ---- replicas ------------------------------------------------------------------------
    @v1.get("/replicas")
    async def list_replicas():
        # `draining` per replica: the gateway sends no new sessions to a draining node's replicas
        return {"draining": ag.draining,
                "replicas": [{**ag.refresh(rid), "draining": ag.draining} for rid in list(ag.reg.replicas)]}

    @v1.post("/replicas", status_code=201)
    async def create_replica(body: ReplicaBody):
        if ag.draining:
            raise AgentError(409, "agent is draining: no new replicas until POST /v1/undrain")
        if body.name and body.name in ag.reg.replicas:
            raise AgentError(409, f"replica {body.name!r} already exists")
        layout = await asyncio.to_thread(validate_layout, body.model, body.layout)
        return await ag.launch(body.model, layout, body.name)

    @v1.get("/replicas/{rid}")
    async def get_replica(rid: str):
        return await ag.describe(rid)

    @v1.delete("/replicas/{rid}")
    async def delete_replica(rid: str):
        ag.get_replica(rid)
        if rid in ag.busy:
            raise AgentError(409, f"replica {rid!r} is busy with operation {ag.busy[rid]}")
        await asyncio.to_thread(ag.stop_replica, rid)
        r = ag.reg.replicas.pop(rid)
        ag.reg.save()
        return {"id": rid, "status": "stopped", "exit_code": r.get("exit_code")}

    def running(rid: str) -> dict:
        r = ag.get_replica(rid)
        if r["status"] != "running":
            raise AgentError(409, f"replica {rid!r} is {r['status']}")
        return r

    # ---- operations ----------------------------------------------------------------------
    @v1.post("/replicas/{rid}/checkpoint", status_code=202)
    async def checkpoint(rid: str, body: CheckpointBody):
        r = running(rid)
        _check_session_ids(body.sessions)
        dest = body.destination or (ag.data_dir / "checkpoints").as_uri()
        if body.destination:
            from storage.stores import open_store

            try:
                if dest.startswith("file:"):
                    open_store(dest, [Path(p) for p in ag.file_roots()])
                elif not dest.startswith("s3://"):
                    raise ValueError(f"unsupported destination {dest!r}: use file:///path or s3://bucket/prefix")
            except ValueError as e:
                raise AgentError(400, f"destination: {e}") from None

        async def work(op):
            op["phase"] = "checkpointing"
            req = {"destination": dest, "stop": body.stop}
            if body.sessions is not None:
                req["sessions"] = body.sessions
            res = await ag.replica_post(r["url"], "/v1/sessions/checkpoint", req)
            op.update(bytes_done=res.get("bytes", 0), bytes_total=res.get("bytes", 0))
            return {"checkpoint": res["checkpoint"], "checkpoint_id": res.get("checkpoint_id"),
                    "sessions": res.get("sessions", []), "bytes": res.get("bytes", 0), "replica": rid}

        return {"operation_id": ag.new_op("checkpoint", rid, work)}

    @v1.post("/restore", status_code=202)
    async def restore(body: RestoreBody):
        _check_session_ids(body.sessions)
        from engine.session_routes import RouteError, split_checkpoint_uri

        try:
            split_checkpoint_uri(body.checkpoint)
        except RouteError as e:
            raise AgentError(400, f"checkpoint: {e.message}") from None
        if isinstance(body.replica, str):
            running(body.replica)
            rid, new = body.replica, None
        else:
            if ag.draining:
                raise AgentError(409, "agent is draining")
            new = (body.replica.model, await asyncio.to_thread(validate_layout, body.replica.model, body.replica.layout))
            rid = None

        async def work(op):
            target = rid
            if new is not None:
                op["phase"] = "launching"
                target = (await ag.launch(*new))["id"]
                op["replica"] = target
            op["phase"] = "restoring"
            req: dict[str, Any] = {"checkpoint": body.checkpoint}
            if body.sessions is not None:
                req["sessions"] = body.sessions
            res = await ag.replica_post(ag.reg.replicas[target]["url"], "/v1/sessions/restore", req)
            return {"replica": target, "sessions": res.get("sessions", [])}

        return {"operation_id": ag.new_op("restore", rid, work)}

    @v1.post("/replicas/{rid}/migrate", status_code=202)
    async def migrate(rid: str, body: MigrateBody):
        r = running(rid)
        _check_session_ids(body.sessions)
        try:
            from migrate.live import migrate_live  # type: ignore[import-not-found]
        except ImportError:
            raise AgentError(501, "live migration is not available in this build (migrate.live missing); "
                                  "use checkpoint + restore") from None
        t = body.target
        if t.replica is None and t.layout is None:
            raise AgentError(400, "target: give either replica or layout")
        agent_url = t.agent.rstrip("/")

        async def work(op):
            op["phase"] = "resolving target"
            async with httpx.AsyncClient(timeout=OP_TIMEOUT) as c:
                if t.replica is not None:
                    resp = await c.get(f"{agent_url}/v1/replicas/{t.replica}", headers=ag.headers())
                else:
                    resp = await c.post(f"{agent_url}/v1/replicas", headers=ag.headers(),
                                        json={"model": t.model or r["model"], "layout": t.layout})
            if resp.status_code >= 400:
                raise AgentError(502, f"target agent answered {resp.status_code}: {resp.text[:300]}")
            tr = resp.json()
            op["phase"] = "migrating"

            def progress(phase=None, bytes_done=None, *_, **__):  # migrate_live calls progress(phase, bytes)
                if phase is not None:
                    op["phase"] = phase
                if bytes_done is not None:
                    op["bytes_done"] = bytes_done

            res = await asyncio.to_thread(migrate_live, r["url"], tr["url"], sessions=body.sessions,
                                          token=ag.token, mode=body.mode, progress=progress)
            get = (lambda k, d=None: res.get(k, d)) if isinstance(res, dict) else (lambda k, d=None: getattr(res, k, d))
            op["stall_ms"] = get("stall_ms")
            if get("bytes_total") is not None:
                op["bytes_done"] = op["bytes_total"] = get("bytes_total")
            return {"replica": tr["id"], "sessions": list(get("sessions", []) or [])}

        return {"operation_id": ag.new_op("migrate", rid, work)}

    @v1.get("/operations")
    async def list_operations():
        return {"operations": list(ag.reg.operations.values())[-200:]}

    @v1.get("/operations/{oid}")
    async def get_operation(oid: str):
        check_id(oid, "operation")
        op = ag.reg.operations.get(oid)
        if op is None:
            raise AgentError(404, f"no operation {oid!r}")
        return op

    @v1.post("/drain", status_code=202)
    async def drain(body: DrainBody):
        if ag.drain_op is not None and ag.reg.operations.get(ag.drain_op, {}).get("state") in ("pending", "running"):
            raise AgentError(409, f"a drain is already running: operation {ag.drain_op}")
        target = body.target_agent.rstrip("/")
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as c:
                h = (await c.get(f"{target}/healthz")).json()
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, TypeError, UnicodeError, OSError) as e:
            raise AgentError(400, f"target_agent {target} is unreachable: {type(e).__name__}") from None
        if not isinstance(h, dict) or h.get("status") != "ok":
            raise AgentError(400, f"target_agent {target} is not a healthy relayout agent")
        if h.get("agent_id") == ag.agent_id:
            raise AgentError(400, "target_agent is this agent: drain to another node")
        if h.get("draining"):
            raise AgentError(409, f"target_agent {target} is draining itself")
        ag.draining = True  # from now on: no new replicas here, and the gateways stop routing here
        ag.drain_op = ag.new_op("drain", None, lambda op: drain_node(ag, op, target))
        return {"operation_id": ag.drain_op}

    @v1.post("/undrain")
    async def undrain():
        if ag.drain_op is not None and ag.reg.operations.get(ag.drain_op, {}).get("state") in ("pending", "running"):
            raise AgentError(409, f"drain operation {ag.drain_op} is still running")
        ag.draining = False
        return {"draining": False}

    # ---- checkpoints ---------------------------------------------------------------------
    def store():
        from storage.store_local import LocalStore

        return LocalStore(ag.data_dir / "checkpoints")

    def summary(cid: str) -> dict:
        from storage.errors import StorageError
        from storage.manifest import Manifest

        try:
            m = Manifest.parse(store().get_manifest(cid))
        except StorageError as e:
            raise AgentError(404 if "not found" in str(e) else 409, str(e)) from None
        sizes = {e.chunk.hash: e.chunk.size for e in m.kv_entries}
        return {"id": cid, "uri": f"{(ag.data_dir / 'checkpoints').as_uri()}/{cid}", "created_at": m.created_at,
                "model": m.model.name, "source_layout": m.source_layout,
                "sessions": [{"id": s.session_id, "num_tokens": s.num_kv_tokens} for s in m.sessions],
                "bytes": sum(sizes.values())}

    @v1.get("/checkpoints")
    async def list_checkpoints():
        ids = await asyncio.to_thread(lambda: store().list_checkpoints())
        return {"checkpoints": [{"id": i, "uri": f"{(ag.data_dir / 'checkpoints').as_uri()}/{i}"} for i in ids]}

    @v1.get("/checkpoints/{cid}")
    async def get_checkpoint(cid: str):
        check_id(cid, "checkpoint")
        return await asyncio.to_thread(summary, cid)

    @v1.delete("/checkpoints/{cid}")
    async def delete_checkpoint(cid: str):
        from storage.errors import CheckpointNotFound

        check_id(cid, "checkpoint")
        try:
            await asyncio.to_thread(lambda: store().delete_checkpoint(cid))
        except CheckpointNotFound:
            raise AgentError(404, f"no checkpoint {cid!r}") from None
        return {"id": cid, "deleted": True}

    app.include_router(v1)
    return app


def serve_agent(host: str, port: int, data_dir: Path, token: str | None) -> None:
    import uvicorn

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = create_agent_app(data_dir, token, advertise_host=host if host not in ("0.0.0.0", "::") else "127.0.0.1")

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else port
                print(f"relayout agent on http://{host}:{bound}", flush=True)

    try:
        _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)).run()
    finally:
        ag: Agent = app.state.agent
        if any(r.get("status") == "running" and r["id"] in ag.procs for r in ag.reg.replicas.values()):
            ag.stop_all()


# ---- relayout up: agent + one replica + gateway on this machine ----------------------------------------------
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

    p = subprocess.Popen(_relayout_cmd() + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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
           layout: str | None = None, log=print) -> int:
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
