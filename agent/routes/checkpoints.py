"""The agent's own checkpoint store (docs/agent-api.md "Checkpoints"): list, describe, delete."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from relayout.agent.node.state import Agent
from relayout.engine import web
from relayout.engine.web import HTTPError
from relayout.storage.errors import CheckpointNotFound, StorageError
from relayout.storage.format.manifest import Manifest
from relayout.storage.stores.local import LocalStore


def checkpoints_router(ag: Agent) -> APIRouter:
    """Routes to include in the agent's authenticated /v1 router."""
    r = APIRouter()
    root = ag.data_dir / "checkpoints"

    def summary(cid: str) -> dict:
        try:
            m = Manifest.parse(LocalStore(root).get_manifest(cid))
        except StorageError as e:
            raise HTTPError(404 if "not found" in str(e) else 409, str(e)) from None
        sizes = {e.chunk.hash: e.chunk.size for e in m.kv_entries}
        return {"id": cid, "uri": f"{root.as_uri()}/{cid}", "created_at": m.created_at,
                "model": m.model.name, "source_layout": m.source_layout,
                "sessions": [{"id": s.session_id, "num_tokens": s.num_kv_tokens} for s in m.sessions],
                "bytes": sum(sizes.values())}

    @r.get("/checkpoints")
    async def list_checkpoints():
        ids = await asyncio.to_thread(lambda: LocalStore(root).list_checkpoints())
        return {"checkpoints": [{"id": i, "uri": f"{root.as_uri()}/{i}"} for i in ids]}

    @r.get("/checkpoints/{cid}")
    async def get_checkpoint(cid: str):
        web.check_id(cid, "checkpoint", 404)
        return await asyncio.to_thread(summary, cid)

    @r.delete("/checkpoints/{cid}")
    async def delete_checkpoint(cid: str):
        web.check_id(cid, "checkpoint", 404)
        try:
            await asyncio.to_thread(lambda: LocalStore(root).delete_checkpoint(cid))
        except CheckpointNotFound:
            raise HTTPError(404, f"no checkpoint {cid!r}") from None
        return {"id": cid, "deleted": True}

    return r
