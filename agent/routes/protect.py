"""The agent's protection routes (docs/agent-api.md): `POST /v1/replicas/{id}/protect` resolves the
standby — an existing replica on some agent, or a new one launched there with a layout — and
starts the replica's continuous replication to it (migrate.protection.replication); `GET` shows it (each
session's replication lag), `DELETE` stops it (the standby frees its copies)."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from relayout.agent.node.registry import ReplicaRecord
from relayout.agent.node.schema import OP_TIMEOUT
from relayout.agent.node.state import Agent, agent_of
from relayout.engine import web
from relayout.engine.web import HTTPError, tls_context
from relayout.migrate.protection.replication import LEASE_S


class StandbyRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    agent: str = Field(..., max_length=2048)
    replica: str | None = Field(None, max_length=128)  # an existing replica there
    layout: str | dict | None = None  # or launch one with this layout (the source's model unless `model`)
    model: str | None = Field(None, max_length=4096)
    # the launched standby's engine (default: the source's; a vLLM one gets the source's vllm_args)
    engine: str | None = Field(None, pattern="^(builtin|vllm)$")


class ProtectBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    standby: StandbyRef
    every_tokens: int = Field(16, ge=1, le=1 << 20)
    every_ms: int = Field(200, ge=10, le=600_000)
    lease_s: float = Field(LEASE_S, ge=0.2, le=600)


async def _standby_url(ag: Agent, source: ReplicaRecord, ref: StandbyRef) -> tuple[str, str]:
    """(replica id, URL) of the standby, launching it when `ref` gives a layout."""
    if (ref.replica is None) == (ref.layout is None):
        raise HTTPError(400, "standby: give either replica or layout")
    base = ref.agent.rstrip("/")
    async with httpx.AsyncClient(verify=tls_context(), timeout=OP_TIMEOUT) as c:
        if ref.replica is not None:
            web.check_id(ref.replica, "replica id")
            resp = await c.get(f"{base}/v1/replicas/{ref.replica}", headers=ag.headers())
        else:
            engine = ref.engine or source.engine
            vargs = source.vllm_args if engine == "vllm" == source.engine else []
            resp = await c.post(f"{base}/v1/replicas", headers=ag.headers(),
                                json={"model": ref.model or source.model, "layout": ref.layout, "engine": engine,
                                      **({"vllm_args": vargs} if vargs else {})})
    if resp.status_code >= 400:
        raise HTTPError(502, f"standby agent answered {resp.status_code}: {web.error_message(resp)[:300]}")
    r = resp.json()
    return r["id"], r["url"]


async def _replica_call(ag: Agent, method: str, url: str, body: dict | None = None) -> dict:
    async with httpx.AsyncClient(verify=tls_context(), timeout=30) as c:
        resp = await c.request(method, f"{url}/v1/protection", json=body, headers=ag.headers())
    if resp.status_code >= 400:
        raise HTTPError(resp.status_code if resp.status_code < 500 else 502,
                        f"replica /v1/protection failed ({resp.status_code}): {web.error_message(resp)[:300]}")
    return resp.json()


async def protection_of(ag: Agent, url: str | None, timeout: float = 5.0) -> dict | None:
    """The replica's protection (sessions' replication lag), None when it is not protected or down."""
    if not url:
        return None
    try:
        async with httpx.AsyncClient(verify=tls_context(), timeout=timeout) as c:
            resp = await c.get(f"{url}/v1/protection", headers=ag.headers())
    except httpx.HTTPError:
        return None
    return resp.json() if resp.status_code == 200 else None


router = APIRouter()  # in the agent's authenticated /v1 router (create_agent_app)


@router.post("/replicas/{rid}/protect")
async def protect(rid: str, body: ProtectBody, ag: Agent = Depends(agent_of)):
    src = ag.running_replica(rid)
    standby_id, standby_url = await _standby_url(ag, src, body.standby)
    if standby_url.rstrip("/") == (src.url or "").rstrip("/"):
        raise HTTPError(400, "a replica cannot be its own standby")
    res = await _replica_call(ag, "POST", src.url, {"standby": standby_url, "every_tokens": body.every_tokens,
                                                       "every_ms": body.every_ms, "lease_s": body.lease_s})
    return {**res, "replica": rid, "standby_replica": standby_id}


@router.get("/replicas/{rid}/protect")
async def protection(rid: str, ag: Agent = Depends(agent_of)):
    return await _replica_call(ag, "GET", ag.running_replica(rid).url)


@router.delete("/replicas/{rid}/protect")
async def unprotect(rid: str, ag: Agent = Depends(agent_of)):
    return await _replica_call(ag, "DELETE", ag.running_replica(rid).url)
