"""The node agent (docs/agent-api.md): launches replicas on this node, runs checkpoint / restore /
migration operations against them, and lists its own checkpoint store.

`create_agent_app(data_dir, token)` builds the FastAPI app; `relayout agent` serves it."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest
from relayout.agent.drain import check_drain_targets, drain_node
from relayout.agent.failover import HealthCheck
from relayout.agent.node import Agent, check_dtypes
from relayout.agent.protect import protect_router, protection_of
from relayout.agent.schema import (
    OP_TIMEOUT,
    CheckpointBody,
    DrainBody,
    MigrateBody,
    ReplicaBody,
    RestoreBody,
    validate_layout,
)
from relayout.engine import tracing, web
from relayout.engine.web import HTTPError, tls_context


def create_agent_app(data_dir: Path, token: str | None, advertise_host: str = "127.0.0.1") -> FastAPI:
    ag = Agent(Path(data_dir), token or None, advertise_host)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(ag.startup)
        health = asyncio.get_running_loop().create_task(HealthCheck(ag).run())
        ag.tasks.add(health)  # cancelled with the others at shutdown
        try:
            yield
        finally:
            for t in list(ag.tasks):
                t.cancel()
            await asyncio.to_thread(ag.stop_all)

    app = FastAPI(title="relayout agent", version="1", lifespan=lifespan)
    app.state.agent = ag

    # every body is a small JSON document: 1 MiB at most; errors as {"error": {"code": slug, "message"}}
    app.add_middleware(web.BodyLimit, limit=lambda _path: web.MAX_JSON_BODY, dialect="agent")
    web.install_error_handlers(app, dialect="agent", validation_status=422)
    tracing.install_tracing(app)  # when OTEL_* configure an exporter: a span per request, traceparent honoured
    auth = web.bearer_auth(lambda: ag.token)

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
            ag.m.replicas.labels(st).set(counts.get(st, 0))
        # per-replica sessions and KV blocks, as the replicas answer now (describe() records them)
        # (briefly: a scrape must not hang on a busy replica; one that does not answer keeps its last figures)
        await asyncio.gather(*(ag.describe(rid, timeout=2.0) for rid in list(ag.reg.replicas)
                               if ag.reg.replicas[rid].get("status") == "running"))
        running = [rid for rid in list(ag.reg.replicas) if ag.reg.replicas[rid].get("status") == "running"]
        prots = await asyncio.gather(*(protection_of(ag, ag.reg.replicas[rid].get("url"), timeout=2.0)
                                       for rid in running))
        for rid, prot in zip(running, prots, strict=True):
            if prot and prot.get("sessions") is not None:
                ag.m.observe_protection(rid, prot)
        ag.m.sessions.set(sum(ag.sessions_seen.values()))
        ag.m.draining.set(1 if ag.draining else 0)
        return PlainTextResponse(generate_latest(ag.m.registry).decode(), media_type="text/plain; version=0.0.4")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth)])

    # ---- replicas ------------------------------------------------------------------------
    @v1.get("/replicas")
    async def list_replicas():
        # `draining` per replica: the gateway sends no new sessions to a draining node's replicas
        return {"draining": ag.draining,
                "replicas": [{"engine": "builtin", **ag.refresh(rid), "draining": ag.draining}
                             for rid in list(ag.reg.replicas)]}

    @v1.post("/replicas", status_code=201)
    async def create_replica(body: ReplicaBody):
        if ag.draining:
            raise HTTPError(409, "agent is draining: no new replicas until POST /v1/undrain")
        if body.name and body.name in ag.reg.replicas:
            raise HTTPError(409, f"replica {body.name!r} already exists")
        vargs = body.checked_vllm_args()
        layout = await asyncio.to_thread(validate_layout, body.model, body.layout, body.engine)
        return await ag.launch(body.model, layout, body.name, dtype=body.dtype, kv_dtype=body.kv_dtype,
                               engine=body.engine, vllm_args=vargs)

    @v1.get("/replicas/{rid}")
    async def get_replica(rid: str):
        d = await ag.describe(rid)
        prot = await protection_of(ag, d.get("url") if d.get("status") == "running" else None)
        return {**d, "protection": prot} if prot else d  # with each session's replication lag

    @v1.delete("/replicas/{rid}")
    async def delete_replica(rid: str):
        ag.get_replica(rid)
        if rid in ag.busy:
            raise HTTPError(409, f"replica {rid!r} is busy with operation {ag.busy[rid]}")
        await asyncio.to_thread(ag.stop_replica, rid)
        r = ag.reg.replicas.pop(rid)
        ag.reg.save()
        return {"id": rid, "status": "stopped", "exit_code": r.get("exit_code")}

    def running(rid: str) -> dict:
        r = ag.get_replica(rid)
        if r["status"] != "running":
            raise HTTPError(409, f"replica {rid!r} is {r['status']}")
        return r

    # ---- operations ----------------------------------------------------------------------
    @v1.post("/replicas/{rid}/checkpoint", status_code=202)
    async def checkpoint(rid: str, body: CheckpointBody):
        r = running(rid)
        web.check_ids(body.sessions)
        dest = body.destination or (ag.data_dir / "checkpoints").as_uri()
        if body.destination:
            from relayout.storage.stores import open_store

            try:
                if dest.startswith("file:"):
                    open_store(dest, [Path(p) for p in ag.file_roots()])
                elif not dest.startswith("s3://"):
                    raise ValueError(f"unsupported destination {dest!r}: use file:///path or s3://bucket/prefix")
            except ValueError as e:
                raise HTTPError(400, f"destination: {e}") from None

        async def work(op):
            op["phase"] = "checkpointing"
            req = {"destination": dest, "stop": body.stop}
            if body.sessions is not None:
                req["sessions"] = body.sessions
            t0 = time.perf_counter()
            with tracing.span("checkpointing", destination=dest) as sp:
                res = await ag.replica_post(r["url"], "/v1/sessions/checkpoint", req)
                sp.set_attributes(tracing.attributes({"bytes": res.get("bytes", 0), "sessions": res.get("sessions")}))
            ag.m.observe_checkpoint(res.get("bytes", 0), time.perf_counter() - t0)
            op.update(bytes_done=res.get("bytes", 0), bytes_total=res.get("bytes", 0))
            return {"checkpoint": res["checkpoint"], "checkpoint_id": res.get("checkpoint_id"),
                    "sessions": res.get("sessions", []), "bytes": res.get("bytes", 0), "replica": rid}

        return {"operation_id": ag.new_op("checkpoint", rid, work)}

    @v1.post("/restore", status_code=202)
    async def restore(body: RestoreBody):
        web.check_ids(body.sessions)
        from relayout.migrate.replica_routes import split_checkpoint_uri

        try:
            split_checkpoint_uri(body.checkpoint)
        except HTTPError as e:
            raise HTTPError(400, f"checkpoint: {e.message}") from None
        if isinstance(body.replica, str):
            running(body.replica)
            rid, new = body.replica, None
        else:
            if ag.draining:
                raise HTTPError(409, "agent is draining")
            nr = body.replica
            check_dtypes(nr.dtype, nr.kv_dtype)
            vargs = nr.checked_vllm_args()
            new = (nr.model, await asyncio.to_thread(validate_layout, nr.model, nr.layout, nr.engine), None, nr.dtype,
                   nr.kv_dtype, nr.engine, vargs)
            rid = None

        async def work(op):
            target = rid
            if new is not None:
                op["phase"] = "launching"
                with tracing.span("launching", model=new[0], layout=new[1]):
                    target = (await ag.launch(*new))["id"]
                op["replica"] = target
            op["phase"] = "restoring"
            req: dict[str, Any] = {"checkpoint": body.checkpoint, "exact": body.exact}
            if body.sessions is not None:
                req["sessions"] = body.sessions
            t0 = time.perf_counter()
            with tracing.span("restoring", checkpoint=body.checkpoint, replica=target) as sp:
                res = await ag.replica_post(ag.reg.replicas[target]["url"], "/v1/sessions/restore", req)
                sp.set_attributes(tracing.attributes({"sessions": res.get("sessions")}))
            ag.m.restore_seconds.observe(time.perf_counter() - t0)
            return {"replica": target, "sessions": res.get("sessions", []), "converted": res.get("converted")}

        return {"operation_id": ag.new_op("restore", rid, work)}

    @v1.post("/replicas/{rid}/migrate", status_code=202)
    async def migrate(rid: str, body: MigrateBody):
        r = running(rid)
        web.check_ids(body.sessions)
        try:
            from relayout.migrate.live import migrate_live  # type: ignore[import-not-found]
        except ImportError:
            raise HTTPError(501, "live migration is not available in this build (migrate.live missing); "
                                  "use checkpoint + restore") from None
        t = body.target
        if t.replica is None and t.layout is None:
            raise HTTPError(400, "target: give either replica or layout")
        agent_url = t.agent.rstrip("/")

        async def work(op):
            op["phase"] = "resolving target"
            async with ag.client(OP_TIMEOUT) as c:
                if t.replica is not None:
                    resp = await c.get(f"{agent_url}/v1/replicas/{t.replica}", headers=ag.headers())
                else:
                    # a new target: the source's engine (and its vLLM flags) unless the caller names another
                    engine = t.engine or r.get("engine", "builtin")
                    spec = {"model": t.model or r["model"], "layout": t.layout, "engine": engine}
                    if engine == r.get("engine", "builtin") and r.get("vllm_args"):
                        spec["vllm_args"] = r["vllm_args"]
                    resp = await c.post(f"{agent_url}/v1/replicas", headers=ag.headers(), json=spec)
            if resp.status_code >= 400:
                raise HTTPError(502, f"target agent answered {resp.status_code}: {web.error_message(resp)[:300]}")
            tr = resp.json()
            op["target_replica"] = tr["id"]  # known even if the move then fails (the caller may drop it)
            op["phase"] = "migrating"

            def progress(phase=None, bytes_done=None, *_, **__):  # migrate_live calls progress(phase, bytes)
                if phase is not None:
                    op["phase"] = phase
                if bytes_done is not None:
                    op["bytes_done"] = bytes_done

            from relayout.migrate.live import new_transfer_id

            op["transfer"] = tid = new_transfer_id()  # the id both replicas know it by (their transfer state)
            res = await asyncio.to_thread(migrate_live, r["url"], tr["url"], sessions=body.sessions,
                                          token=ag.token, mode=body.mode, progress=progress, transport=body.transport,
                                          transfer_id=tid)
            ag.m.observe_migration(res)
            get = (lambda k, d=None: res.get(k, d)) if isinstance(res, dict) else (lambda k, d=None: getattr(res, k, d))
            op["stall_ms"] = get("stall_ms")
            if get("bytes_total") is not None:
                op["bytes_done"] = op["bytes_total"] = get("bytes_total")
            not_moved = get("not_moved", {}) or {}
            # exactly what moved, and every session that did not with the source's reason
            return {"replica": tr["id"], "sessions": list(get("sessions", []) or []),
                    "sessions_not_moved": [{"id": k, "error": v} for k, v in sorted(not_moved.items())]}

        return {"operation_id": ag.new_op("migrate", rid, work)}

    @v1.get("/operations")
    async def list_operations():
        return {"operations": list(ag.reg.operations.values())[-200:]}

    @v1.get("/operations/{oid}")
    async def get_operation(oid: str):
        web.check_id(oid, "operation", 404)
        op = ag.reg.operations.get(oid)
        if op is None:
            raise HTTPError(404, f"no operation {oid!r}")
        return op

    @v1.post("/drain", status_code=202)
    async def drain(body: DrainBody):
        if ag.drain_op is not None and ag.reg.operations.get(ag.drain_op, {}).get("state") in ("pending", "running"):
            raise HTTPError(409, f"a drain is already running: operation {ag.drain_op}")
        target = body.target_agent.rstrip("/")
        try:
            async with httpx.AsyncClient(verify=tls_context(), timeout=httpx.Timeout(5.0)) as c:
                h = (await c.get(f"{target}/healthz")).json()
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, TypeError, UnicodeError, OSError) as e:
            raise HTTPError(400, f"target_agent {target} is unreachable: {type(e).__name__}") from None
        if not isinstance(h, dict) or h.get("status") != "ok":
            raise HTTPError(400, f"target_agent {target} is not a healthy relayout agent")
        if h.get("agent_id") == ag.agent_id:
            raise HTTPError(400, "target_agent is this agent: drain to another node")
        if h.get("draining"):
            raise HTTPError(409, f"target_agent {target} is draining itself")
        layouts: dict[str, str | None] = {}
        for rid, lay in (body.layouts or {}).items():
            if not web.ID_RE.fullmatch(rid) or rid not in ag.reg.replicas:
                raise HTTPError(400, f"layouts: no replica {rid!r} on this node")
            layouts[rid] = await asyncio.to_thread(validate_layout, ag.reg.replicas[rid]["model"], lay)
        into = await check_drain_targets(ag, target, body.target_replicas or {}, layouts)
        ag.draining = True  # from now on: no new replicas here, and the gateways stop routing here
        ag.drain_op = ag.new_op("drain", None, lambda op: drain_node(ag, op, target, layouts, into))
        return {"operation_id": ag.drain_op}

    @v1.post("/undrain")
    async def undrain():
        if ag.drain_op is not None and ag.reg.operations.get(ag.drain_op, {}).get("state") in ("pending", "running"):
            raise HTTPError(409, f"drain operation {ag.drain_op} is still running")
        ag.draining = False
        return {"draining": False}

    # ---- checkpoints ---------------------------------------------------------------------
    def store():
        from relayout.storage.store_local import LocalStore

        return LocalStore(ag.data_dir / "checkpoints")

    def summary(cid: str) -> dict:
        from relayout.storage.errors import StorageError
        from relayout.storage.manifest import Manifest

        try:
            m = Manifest.parse(store().get_manifest(cid))
        except StorageError as e:
            raise HTTPError(404 if "not found" in str(e) else 409, str(e)) from None
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
        web.check_id(cid, "checkpoint", 404)
        return await asyncio.to_thread(summary, cid)

    @v1.delete("/checkpoints/{cid}")
    async def delete_checkpoint(cid: str):
        from relayout.storage.errors import CheckpointNotFound

        web.check_id(cid, "checkpoint", 404)
        try:
            await asyncio.to_thread(lambda: store().delete_checkpoint(cid))
        except CheckpointNotFound:
            raise HTTPError(404, f"no checkpoint {cid!r}") from None
        return {"id": cid, "deleted": True}

    v1.include_router(protect_router(ag))
    app.include_router(v1)
    return app


def serve_agent(host: str, port: int, data_dir: Path, token: str | None) -> None:
    import uvicorn

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    tracing.setup_tracing("relayout-agent")  # a no-op unless OTEL_* variables configure an exporter
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
