"""The agent's operations (docs/agent-api.md "Operations"): checkpoint, restore and migrate, each
started by a thin route that checks the request and run as an operation (`Agent.new_op`) by the
function below it; `GET /v1/operations[/{id}]` report them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from relayout.agent.node.registry import Operation, ReplicaRecord
from relayout.agent.node.schema import OP_TIMEOUT, CheckpointBody, MigrateBody, RestoreBody, validate_layout
from relayout.agent.node.state import Agent, agent_of, check_dtypes
from relayout.engine import tracing, web
from relayout.engine.web import HTTPError


async def run_checkpoint(ag: Agent, op: Operation, rid: str, url: str, dest: str, body: CheckpointBody) -> dict:
    op.phase = "checkpointing"
    req: dict[str, Any] = {"destination": dest, "stop": body.stop}
    if body.sessions is not None:
        req["sessions"] = body.sessions
    t0 = time.perf_counter()
    with tracing.span("checkpointing", destination=dest) as sp:
        res = await ag.replica_post(url, "/v1/sessions/checkpoint", req)
        sp.set_attributes(tracing.attributes({"bytes": res.get("bytes", 0), "sessions": res.get("sessions")}))
    ag.m.observe_checkpoint(res.get("bytes", 0), time.perf_counter() - t0)
    op.bytes_done = op.bytes_total = res.get("bytes", 0)
    return {"checkpoint": res["checkpoint"], "checkpoint_id": res.get("checkpoint_id"),
            "sessions": res.get("sessions", []), "bytes": res.get("bytes", 0), "replica": rid}


async def run_restore(ag: Agent, op: Operation, rid: str | None, new: tuple | None, body: RestoreBody) -> dict:
    """Into replica `rid`, or into one launched first from `new` (Agent.launch's arguments)."""
    target = rid
    if new is not None:
        op.phase = "launching"
        with tracing.span("launching", model=new[0], layout=new[1]):
            target = (await ag.launch(*new))["id"]
        op.replica = target
    assert target is not None
    op.phase = "restoring"
    req: dict[str, Any] = {"checkpoint": body.checkpoint, "exact": body.exact}
    if body.sessions is not None:
        req["sessions"] = body.sessions
    t0 = time.perf_counter()
    with tracing.span("restoring", checkpoint=body.checkpoint, replica=target) as sp:
        res = await ag.replica_post(ag.reg.replicas[target].url, "/v1/sessions/restore", req)
        sp.set_attributes(tracing.attributes({"sessions": res.get("sessions")}))
    ag.m.restore_seconds.observe(time.perf_counter() - t0)
    return {"replica": target, "sessions": res.get("sessions", []), "converted": res.get("converted"),
            "recomputed": res.get("recomputed") or {}}


async def run_migrate(ag: Agent, op: Operation, src: ReplicaRecord, body: MigrateBody) -> dict:
    from relayout.migrate.protocol.live import MigrationPlan, migrate_live, new_transfer_id

    t = body.target
    agent_url = t.agent.rstrip("/")
    op.phase = "resolving target"
    async with ag.client(OP_TIMEOUT) as c:
        if t.replica is not None:
            resp = await c.get(f"{agent_url}/v1/replicas/{t.replica}", headers=ag.headers())
        else:
            # a new target: the source's engine (and its vLLM flags) unless the caller names another
            engine = t.engine or src.engine
            spec = {"model": t.model or src.model, "layout": t.layout, "engine": engine}
            if engine == src.engine and src.vllm_args:
                spec["vllm_args"] = src.vllm_args
            resp = await c.post(f"{agent_url}/v1/replicas", headers=ag.headers(), json=spec)
    if resp.status_code >= 400:
        raise HTTPError(502, f"target agent answered {resp.status_code}: {web.error_message(resp)[:300]}")
    tr = resp.json()
    op.target_replica = tr["id"]  # known even if the move then fails (the caller may drop it)
    op.phase = "migrating"

    def progress(phase: str | None = None, bytes_done: int | None = None) -> None:
        if phase is not None:
            op.phase = phase
        if bytes_done is not None:
            op.bytes_done = bytes_done

    op.transfer = tid = new_transfer_id()  # the id both replicas know it by (their transfer state)
    plan = MigrationPlan(mode=body.mode, transport=body.transport, transfer_id=tid)
    res = await asyncio.to_thread(migrate_live, src.url, tr["url"], body.sessions, token=ag.token, plan=plan,
                                  progress=progress)
    ag.m.observe_migration(res)
    op.stall_ms = res.stall_ms
    op.bytes_done = op.bytes_total = res.bytes_total
    # exactly what moved, and every session that did not with the source's reason
    return {"replica": tr["id"], "sessions": list(res.sessions),
            "sessions_not_moved": [{"id": k, "error": v} for k, v in sorted(res.not_moved.items())]}


router = APIRouter()  # in the agent's authenticated /v1 router (create_agent_app)


@router.post("/replicas/{rid}/checkpoint", status_code=202)
async def checkpoint(rid: str, body: CheckpointBody, ag: Agent = Depends(agent_of)):
    rep = ag.running_replica(rid)
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
    return {"operation_id": ag.new_op("checkpoint", rid,
                                      lambda op: run_checkpoint(ag, op, rid, rep.url, dest, body))}


@router.post("/restore", status_code=202)
async def restore(body: RestoreBody, ag: Agent = Depends(agent_of)):
    from relayout.migrate.replica.routes import split_checkpoint_uri

    web.check_ids(body.sessions)
    try:
        split_checkpoint_uri(body.checkpoint)
    except HTTPError as e:
        raise HTTPError(400, f"checkpoint: {e.message}") from None
    rid: str | None = None
    new: tuple | None = None
    if isinstance(body.replica, str):
        ag.running_replica(body.replica)
        rid = body.replica
    else:
        if ag.draining:
            raise HTTPError(409, "agent is draining")
        nr = body.replica
        check_dtypes(nr.dtype, nr.kv_dtype)
        vargs = nr.checked_vllm_args()
        new = (nr.model, await asyncio.to_thread(validate_layout, nr.model, nr.layout, nr.engine), None, nr.dtype,
               nr.kv_dtype, nr.engine, vargs)
    return {"operation_id": ag.new_op("restore", rid, lambda op: run_restore(ag, op, rid, new, body))}


@router.post("/replicas/{rid}/migrate", status_code=202)
async def migrate(rid: str, body: MigrateBody, ag: Agent = Depends(agent_of)):
    rep = ag.running_replica(rid)
    web.check_ids(body.sessions)
    if body.target.replica is None and body.target.layout is None:
        raise HTTPError(400, "target: give either replica or layout")
    return {"operation_id": ag.new_op("migrate", rid, lambda op: run_migrate(ag, op, rep, body))}


@router.get("/operations")
async def list_operations(ag: Agent = Depends(agent_of)):
    return {"operations": [op.view() for op in list(ag.reg.operations.values())[-200:]]}


@router.get("/operations/{oid}")
async def get_operation(oid: str, ag: Agent = Depends(agent_of)):
    web.check_id(oid, "operation", 404)
    op = ag.reg.operations.get(oid)
    if op is None:
        raise HTTPError(404, f"no operation {oid!r}")
    return op.view()
