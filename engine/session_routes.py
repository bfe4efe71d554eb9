"""Replica routes that move sessions: checkpoint to a store, restore from one, and the
live-transfer rounds (export frames on the source, import frames on the target).

A live transfer is the same manifest + chunks as a checkpoint, framed (storage.stream):
each round streams only chunks the target lacks plus a cumulative manifest. These routes
need the replica's bearer token when it has one (RELAYOUT_TOKEN)."""

from __future__ import annotations

import asyncio
import hmac
import os
import re
from collections.abc import Iterator
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.async_engine import AsyncEngine
from engine.engine import LLMEngine
from engine.snapshot import (
    IncomingTransfer,
    OutgoingTransfer,
    RestoreError,
    abort_incoming,
    geometry,
    model_ref,
    new_checkpoint_id,
    receive_round,
    release,
    restore,
    take_snapshot,
    write_snapshot,
)
from storage.checkpoint import CheckpointReader, CheckpointWriter
from storage.errors import StorageError
from storage.store_base import Store
from storage.stores import MemoryStore, open_store
from storage.stream import StreamReceiver, encode_chunk_frame, encode_manifest_frame

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_TRANSFERS = 64


class RouteError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def check_ids(ids: list[str] | None, what: str = "session id") -> list[str] | None:
    for i in ids or []:
        if not isinstance(i, str) or not ID_RE.fullmatch(i):
            raise RouteError(400, f"invalid {what} {i!r}")
    return ids


def split_checkpoint_uri(uri: str) -> tuple[str, str]:
    """`<store uri>/<checkpoint id>` → (store uri, id)."""
    base, _, cid = uri.rstrip("/").rpartition("/")
    if not cid or not ID_RE.fullmatch(cid) or not base:
        raise RouteError(400, f"checkpoint URI must be <store URI>/<checkpoint id>, got {uri!r}")
    return base, cid


def allowed_roots() -> list[Path]:
    roots = os.environ.get("RELAYOUT_FILE_ROOTS")
    if roots:
        return [Path(r).resolve() for r in roots.split(os.pathsep) if r]
    return [Path(os.environ.get("RELAYOUT_DATA_DIR", Path.home() / ".relayout")).resolve()]


class FrameSink(Store):
    """A Store that turns chunks and the manifest into stream frames (nothing is kept)."""

    identity = "frame-sink"

    def __init__(self, already: set[str]):
        self.sent = already
        self.frames: list[bytes] = []

    def has_chunk(self, h: str) -> bool:
        return h in self.sent

    def put_manifest(self, checkpoint_id: str, data: bytes) -> None:
        from storage.manifest import Manifest

        self.frames.append(encode_manifest_frame(Manifest.parse(data), data))

    def pin(self, h: str) -> None:
        pass

    def unpin(self, hashes) -> None:
        pass


class SinkWriter(CheckpointWriter):
    """CheckpointWriter that tells the FrameSink each chunk's reference before putting it."""

    def put_kv(self, session_id, layer, head_lo, head_hi, tok_lo, tok_hi, tensor):  # type: ignore[override]
        from storage.chunks import pack_kv
        from storage.manifest import KVEntry

        self._check_open()
        data, ref = pack_kv(tensor, self.codec)
        entry = KVEntry(session_id=session_id, layer=layer, head_lo=head_lo, head_hi=head_hi,
                        tok_lo=tok_lo, tok_hi=tok_hi, chunk=ref)
        if self._dtype is None:
            self._dtype, self._head_dim = tensor.dtype, int(tensor.shape[3])
        sink: FrameSink = self.store  # type: ignore[assignment]
        if ref.hash not in sink.sent:
            sink.sent.add(ref.hash)
            sink.frames.append(encode_chunk_frame(ref, data))
            self.bytes_written += ref.size
        self._entries.append(entry)
        return entry


class CheckpointBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    destination: str | None = Field(None, max_length=4096)
    checkpoint_id: str | None = Field(None, max_length=128)
    sessions: list[str] | None = Field(None, max_length=4096)
    stop: bool = False
    codec: str = Field("none", pattern="^(none|zstd|zstd-planes)$")


class RestoreBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint: str = Field(..., max_length=4096)
    sessions: list[str] | None = Field(None, max_length=4096)


class ExportBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    transfer: str = Field(..., max_length=128)
    sessions: list[str] | None = Field(None, max_length=4096)
    pause: bool = False  # final round: hold the sessions at this step boundary first
    codec: str = Field("none", pattern="^(none|zstd|zstd-planes)$")


class SessionsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sessions: list[str] = Field(..., max_length=4096)
    migrated_to: str | None = Field(None, max_length=2048)


def install_session_routes(app: FastAPI, aengine: AsyncEngine, token: str | None = None) -> None:
    token = token if token is not None else os.environ.get("RELAYOUT_TOKEN") or None
    outgoing: dict[str, OutgoingTransfer] = {}
    incoming: dict[str, IncomingTransfer] = {}

    def auth(request: Request) -> None:
        if token is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise RouteError(401, "missing or wrong bearer token")

    r = APIRouter(dependencies=[Depends(auth)])

    @r.post("/v1/sessions/checkpoint")
    async def checkpoint_route(body: CheckpointBody):
        check_ids(body.sessions)
        cid = body.checkpoint_id or new_checkpoint_id()
        check_ids([cid], "checkpoint id")
        dest = body.destination or allowed_roots()[0].joinpath("checkpoints").as_uri()
        try:
            store = open_store(dest, allowed_roots())
        except ValueError as e:
            raise RouteError(400, str(e)) from None

        def cut(e: LLMEngine):
            snaps = take_snapshot(e, body.sessions)
            if body.stop:
                e.pause([s.state.session_id for s in snaps])
            return snaps, model_ref(e), e.layout.to_dict(), geometry(e)

        try:
            snaps, mref, lay, geo = await aengine.call(cut)
        except KeyError as e:
            raise RouteError(404, str(e.args[0])) from None
        ids = [s.state.session_id for s in snaps]

        def write():
            with CheckpointWriter(store, cid, codec=body.codec) as w:
                write_snapshot(snaps, w)
                w.commit(mref, lay, geo, {"stop": body.stop})
                return w.bytes_written

        try:
            nbytes = await asyncio.to_thread(write)
        except BaseException:
            if body.stop:
                await aengine.call(lambda e: e.resume(ids))  # nothing committed: the source keeps serving
            raise
        if body.stop:
            await aengine.call(lambda e: release(e, ids))
        return {"checkpoint": f"{dest.rstrip('/')}/{cid}", "checkpoint_id": cid, "sessions": ids, "bytes": nbytes}

    @r.post("/v1/sessions/restore")
    async def restore_route(body: RestoreBody):
        check_ids(body.sessions)
        base, cid = split_checkpoint_uri(body.checkpoint)
        try:
            store = open_store(base, allowed_roots())
        except ValueError as e:
            raise RouteError(400, str(e)) from None
        reader = await asyncio.to_thread(CheckpointReader, store, cid)
        await asyncio.to_thread(reader.verify)  # hashes checked before the engine is touched
        ids = await aengine.call(lambda e: restore(e, reader, body.sessions, verify=False))
        return {"sessions": ids}

    @r.post("/v1/sessions/export")
    async def export_route(body: ExportBody):
        check_ids([body.transfer], "transfer id")
        check_ids(body.sessions)
        t = outgoing.get(body.transfer)
        if t is None:
            if len(outgoing) >= MAX_TRANSFERS:
                raise RouteError(429, "too many transfers in flight")
            t = outgoing[body.transfer] = OutgoingTransfer(body.transfer)
        sent = dict(t.sent_upto)

        def cut(e: LLMEngine):
            if body.pause:
                e.pause(body.sessions or [s.session_id for s in e.sessions.values() if not s.is_finished])
            snaps = take_snapshot(e, body.sessions, sent)
            return snaps, model_ref(e), e.layout.to_dict(), geometry(e)

        try:
            snaps, mref, lay, geo = await aengine.call(cut)
        except KeyError as e:
            raise RouteError(404, str(e.args[0])) from None
        t.rounds += 1

        def frames() -> Iterator[bytes]:
            sink = FrameSink(t.sent_hashes)
            w = SinkWriter(sink, f"{body.transfer}-r{t.rounds}", codec=body.codec)
            w.carry(list(t.entries))
            for snap in snaps:
                write_snapshot([snap], w, sent)
                yield from sink.frames
                sink.frames.clear()
            m = w.commit(mref, lay, geo, {"transfer": body.transfer, "round": t.rounds, "final": body.pause})
            t.entries = list(m.kv_entries)
            for snap in snaps:
                t.sent_upto[snap.state.session_id] = snap.num_kv_tokens
            yield from sink.frames

        return StreamingResponse(frames(), media_type="application/x-relayout-frames")

    @r.post("/v1/sessions/import")
    async def import_route(request: Request, transfer: str, final: bool = False):
        check_ids([transfer], "transfer id")
        t = incoming.get(transfer)
        if t is None:
            if len(incoming) >= MAX_TRANSFERS:
                raise RouteError(429, "too many transfers in flight")
            t = incoming[transfer] = IncomingTransfer(transfer, MemoryStore())
        recv = StreamReceiver(t.store)  # type: ignore[arg-type]
        manifest = None
        async for piece in request.stream():
            if piece:
                manifest = recv.feed(piece) or manifest
        manifest = recv.close()
        try:
            res = await aengine.call(lambda e: receive_round(e, t, manifest, final))
        except BaseException:
            await aengine.call(lambda e: abort_incoming(e, t))
            incoming.pop(transfer, None)
            raise
        if final:
            res["placed"] = list(t.placed)
        return res

    @r.post("/v1/sessions/transfers/{transfer}/commit")
    async def commit_incoming(transfer: str):
        """Target: the source has released the sessions; they run here from now on."""
        check_ids([transfer], "transfer id")
        t = incoming.pop(transfer, None)
        if t is None:
            raise RouteError(404, f"no incoming transfer {transfer!r}")
        def commit(e: LLMEngine) -> None:
            t.placed, placed = [], t.placed  # committed: abort_incoming must only free spare reservations
            abort_incoming(e, t)
            e.resume(placed)
            t.placed = placed

        await aengine.call(commit)
        return {"sessions": t.placed}

    @r.delete("/v1/sessions/transfers/{transfer}")
    async def abort_transfer(transfer: str):
        """Either side: forget the transfer; the target frees reservations and uncommitted sessions."""
        check_ids([transfer], "transfer id")
        outgoing.pop(transfer, None)
        t = incoming.pop(transfer, None)
        if t is not None:
            await aengine.call(lambda e: abort_incoming(e, t))
        return {"aborted": transfer}

    @r.post("/v1/sessions/release")
    async def release_route(body: SessionsBody):
        """Source, two-phase commit: the target holds the sessions now; free them here."""
        check_ids(body.sessions)
        for sid in body.sessions:
            if body.migrated_to:
                aengine.migrated_to[sid] = body.migrated_to
        await aengine.call(lambda e: release(e, body.sessions))
        return {"sessions": body.sessions}

    @r.post("/v1/sessions/resume")
    async def resume_route(body: SessionsBody):
        check_ids(body.sessions)
        await aengine.call(lambda e: e.resume(body.sessions))
        return {"sessions": body.sessions}

    app.include_router(r)

    @app.exception_handler(RouteError)
    async def _route_error(_: Request, e: RouteError):
        from engine.server import error_response

        return error_response(e.status, e.message, "invalid_request_error" if e.status < 500 else "server_error")

    @app.exception_handler(RestoreError)
    async def _restore_error(_: Request, e: RestoreError):
        from engine.server import error_response

        return error_response(409, str(e), "conflict")

    @app.exception_handler(StorageError)
    async def _storage_error(_: Request, e: StorageError):
        from engine.server import error_response

        return error_response(400, f"{type(e).__name__}: {e}", "checkpoint_error")
