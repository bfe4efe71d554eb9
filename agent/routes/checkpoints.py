"""The agent's own checkpoint store (docs/agent-api.md "Checkpoints"): list, describe, delete."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends
from relayout.agent.node.state import Agent, agent_of
from relayout.engine import web
from relayout.engine.web import HTTPError
from relayout.storage.errors import CheckpointNotFound, StorageError
from relayout.storage.format.manifest import Manifest
from relayout.storage.stores.local import LocalStore

router = APIRouter()  # in the agent's authenticated /v1 router (create_agent_app)


def store_root(ag: Agent) -> Path:
    return ag.data_dir / "checkpoints"


def summary(ag: Agent, cid: str) -> dict:
    root = store_root(ag)
    try:
        m = Manifest.parse(LocalStore(root).get_manifest(cid))
    except StorageError as e:
        raise HTTPError(404 if "not found" in str(e) else 409, str(e)) from None
    sizes = {e.chunk.hash: e.chunk.size for e in m.kv_entries}
    return {"id": cid, "uri": f"{root.as_uri()}/{cid}", "created_at": m.created_at,
            "model": m.model.name, "source_layout": m.source_layout,
            "sessions": [{"id": s.session_id, "num_tokens": s.num_kv_tokens} for s in m.sessions],
            "bytes": sum(sizes.values())}


@router.get("/checkpoints")
async def list_checkpoints(ag: Agent = Depends(agent_of)):
    root = store_root(ag)
    ids = await asyncio.to_thread(lambda: LocalStore(root).list_checkpoints())
    return {"checkpoints": [{"id": i, "uri": f"{root.as_uri()}/{i}"} for i in ids]}


@router.get("/checkpoints/{cid}")
async def get_checkpoint(cid: str, ag: Agent = Depends(agent_of)):
    web.check_id(cid, "checkpoint", 404)
    return await asyncio.to_thread(summary, ag, cid)


@router.delete("/checkpoints/{cid}")
async def delete_checkpoint(cid: str, ag: Agent = Depends(agent_of)):
    web.check_id(cid, "checkpoint", 404)
    try:
        await asyncio.to_thread(lambda: LocalStore(store_root(ag)).delete_checkpoint(cid))
    except CheckpointNotFound:
        raise HTTPError(404, f"no checkpoint {cid!r}") from None
    return {"id": cid, "deleted": True}
