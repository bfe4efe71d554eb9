"""The node agent (docs/agent-api.md): launches replicas on this node, runs checkpoint / restore /
migration operations against them, and lists its own checkpoint store.

`create_agent_app(data_dir, token)` builds the FastAPI app from one router per concern
(agent/routes/replicas.py, operations.py, drain.py, checkpoints.py, protect.py) over one `Agent`
(agent/node/state.py); `relayout agent` serves it."""

from __future__ import annotations

import asyncio
import signal
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest
from relayout.agent.node.failover import HealthCheck
from relayout.agent.node.state import Agent, agent_of
from relayout.agent.routes import checkpoints, drain, operations, protect, replicas
from relayout.agent.routes.protect import protection_of
from relayout.engine import tracing, web

health_router = APIRouter()  # unauthenticated: liveness and Prometheus' scrape


@health_router.get("/healthz")
async def healthz(ag: Agent = Depends(agent_of)):
    return {"status": "ok", "draining": ag.draining, "agent_id": ag.agent_id}


@health_router.get("/metrics")
async def metrics(ag: Agent = Depends(agent_of)):
    counts: dict[str, int] = {}
    for rid in list(ag.reg.replicas):
        st = ag.refresh(rid).status
        counts[st] = counts.get(st, 0) + 1
    for st in ("running", "dead", "stopped", "starting"):
        ag.m.replicas.labels(st).set(counts.get(st, 0))
    # per-replica sessions and KV blocks, as the replicas answer now (describe() records them)
    # (briefly: a scrape must not hang on a busy replica; one that does not answer keeps its last figures)
    running = [r for r in list(ag.reg.replicas.values()) if r.status == "running"]
    await asyncio.gather(*(ag.describe(r.id, timeout=2.0) for r in running))
    running = [r for r in running if r.status == "running"]  # one that died meanwhile shows none
    prots = await asyncio.gather(*(protection_of(ag, r.url, timeout=2.0) for r in running))
    for r, prot in zip(running, prots, strict=True):
        if prot and prot.get("sessions") is not None:
            ag.m.observe_protection(r.id, prot)
    ag.m.sessions.set(sum(ag.sessions_seen.values()))
    ag.m.draining.set(1 if ag.draining else 0)
    return PlainTextResponse(generate_latest(ag.m.registry).decode(), media_type="text/plain; version=0.0.4")


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

    app.include_router(health_router)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth)])
    for routes in (replicas, operations, drain, checkpoints, protect):
        v1.include_router(routes.router)  # each handler gets `ag` from app.state (agent_of)
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
        if any(r.status == "running" and r.id in ag.procs for r in ag.reg.replicas.values()):
            ag.stop_all()
