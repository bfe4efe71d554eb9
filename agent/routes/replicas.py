"""The agent's replica routes (docs/agent-api.md "Replicas"): list, launch, describe, stop."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from relayout.agent.node.schema import ReplicaBody, validate_layout
from relayout.agent.node.state import Agent, agent_of
from relayout.agent.routes.protect import protection_of
from relayout.engine.web import HTTPError

router = APIRouter()  # in the agent's authenticated /v1 router (create_agent_app)


@router.get("/replicas")
async def list_replicas(ag: Agent = Depends(agent_of)):
    # `draining` per replica: the gateway sends no new sessions to a draining node's replicas
    return {"draining": ag.draining,
            "replicas": [{**ag.refresh(rid).view(), "draining": ag.draining} for rid in list(ag.reg.replicas)]}


@router.post("/replicas", status_code=201)
async def create_replica(body: ReplicaBody, ag: Agent = Depends(agent_of)):
    if ag.draining:
        raise HTTPError(409, "agent is draining: no new replicas until POST /v1/undrain")
    if body.name and body.name in ag.reg.replicas:
        raise HTTPError(409, f"replica {body.name!r} already exists")
    vargs = body.checked_vllm_args()
    attach = body.checked_attach()
    layout = await asyncio.to_thread(validate_layout, body.model, body.layout, body.engine)
    return await ag.launch(body.model, layout, body.name, dtype=body.dtype, kv_dtype=body.kv_dtype,
                           engine=body.engine, vllm_args=vargs, attach=attach)


@router.get("/replicas/{rid}")
async def get_replica(rid: str, ag: Agent = Depends(agent_of)):
    d = await ag.describe(rid)
    prot = await protection_of(ag, d.get("url") if d.get("status") == "running" else None)
    return {**d, "protection": prot} if prot else d  # with each session's replication lag


@router.delete("/replicas/{rid}")
async def delete_replica(rid: str, ag: Agent = Depends(agent_of)):
    ag.get_replica(rid)
    if rid in ag.busy:
        raise HTTPError(409, f"replica {rid!r} is busy with operation {ag.busy[rid]}")
    await asyncio.to_thread(ag.stop_replica, rid)
    rec = ag.reg.replicas.pop(rid)
    ag.reg.save()
    return {"id": rid, "status": "stopped", "exit_code": rec.exit_code}
