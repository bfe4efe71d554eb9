"""The replica routes that move sessions (docs/replica-api.md): checkpoint to a store, restore
from one, and the live-transfer protocol's routes — a thin HTTP face over
migrate.protocol.transfers.TransferTable.

A live transfer is the same manifest + chunks as a checkpoint, framed (storage.stream): each
round streams only chunks the target lacks plus a manifest listing each session's KV from where the
last round ended (a delta). These routes need the
replica's bearer token when it has one (RELAYOUT_TOKEN)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from relayout.engine.moves.snapshot import (
    RestoreError,
    new_checkpoint_id,
    write_snapshot,
)
from relayout.engine.runtime.async_engine import AsyncEngine, EngineDeadError
from relayout.engine.runtime.session import SessionStatus
from relayout.engine.web import (
    ID_RE,
    MAX_JSON_BODY,
    URL_RE,
    HTTPError,
    bearer_auth,
    bearer_headers,
    check_id,
    check_ids,
    env_token,
    error_response,
    tls_context,
)
from relayout.migrate.protocol.engine_ops import engine_ops_for
from relayout.migrate.protocol.transfers import (
    EngineOps,
    ImportTooLarge,
    RoundCut,
    TooManyTransfers,
    TransferConflict,
    TransferError,
    TransferTable,
    UnknownSession,
    UnknownTransfer,
)
from relayout.migrate.transport.base import (
    IMPORT_PATH,
    HttpTransport,
    PushFailed,
    RoundFrames,
    Transport,
    precopy_mbps,
    progress_stream,
)
from relayout.migrate.transport.frame_link import LINK_PATH, FrameLinkServer, TcpTransport, link_address
from relayout.migrate.transport.frame_sink import FrameOptions
from relayout.migrate.transport.mooncake import MooncakeReceiver, MooncakeTransport, mooncake_router
from relayout.migrate.transport.mooncake import unavailable as mooncake_unavailable
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.errors import StorageError
from relayout.storage.settings import settings
from relayout.storage.stores import open_store
from starlette.requests import ClientDisconnect

# IMPORT_PATH streams its body: bounded by the transfer's import limit instead
STATUS = {TransferConflict: 409, UnknownTransfer: 404, UnknownSession: 404, TooManyTransfers: 429, ImportTooLarge: 413}


def split_checkpoint_uri(uri: str) -> tuple[str, str]:
    """`<store uri>/<checkpoint id>` → (store uri, id)."""
    base, _, cid = uri.rstrip("/").rpartition("/")
    if not cid or not ID_RE.fullmatch(cid) or not base:
        raise HTTPError(400, f"checkpoint URI must be <store URI>/<checkpoint id>, got {uri!r}")
    return base, cid


def allowed_roots() -> list[Path]:
    st = settings()
    return [r.resolve() for r in st.file_root_list()] or [st.data_dir.resolve()]


def _open_store(uri: str):
    try:
        return open_store(uri, allowed_roots())
    except ValueError as e:
        raise HTTPError(400, str(e)) from None


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
    exact: bool = False  # refuse KV of another dtype instead of converting it


class ExportBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    transfer: str = Field(..., max_length=128)
    sessions: list[str] | None = Field(None, max_length=4096)
    pause: bool = False  # final round: hold the sessions at this step boundary first
    codec: str = Field("none", pattern="^(none|zstd|zstd-planes)$")
    # pre-copy rounds: at most this many tokens per session (bounds the engine thread's copy)
    max_tokens: int | None = Field(None, ge=16, le=1 << 24)
    # retry of an interrupted round: chunks the target acknowledged (holds); only the rest are sent
    have: list[str] | None = Field(None, max_length=1 << 20)
    # push mode: this replica sends the round to the target replica at this URL itself (with its own
    # token) and answers with the target's reply; without it, the frames are this request's response
    target: str | None = Field(None, max_length=2048)
    source: str | None = Field(None, max_length=2048)  # this replica's URL as the target can reach it
    timeout_s: float = Field(300.0, gt=0, le=3600)  # the push's network timeout
    transport: str | None = Field(None, pattern="^(http|tcp|mooncake)$")  # default: RELAYOUT_TRANSPORT


class SessionsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sessions: list[str] = Field(..., max_length=4096)
    migrated_to: str | None = Field(None, max_length=2048)
    transfer: str | None = Field(None, max_length=128)  # release: the commit of this transfer (refused if expired)


def source_asker(token: str | None):
    """How a target in doubt asks its source replica for the transfer's outgoing state."""

    async def ask(source: str, tid: str) -> str | None:
        async with httpx.AsyncClient(verify=tls_context(), timeout=5.0) as c:
            resp = await c.get(f"{source.rstrip('/')}/v1/sessions/transfers/{tid}", headers=bearer_headers(token))
        if resp.status_code != 200:
            raise RuntimeError(f"source answered HTTP {resp.status_code}")
        return resp.json().get("outgoing")

    return ask


async def _cut_pieces(request: Request) -> AsyncIterator[bytes]:
    """The request body; a sender that goes away mid-round is a RoundCut to the protocol."""
    try:
        async for piece in request.stream():
            yield piece
    except ClientDisconnect:
        raise RoundCut() from None


def _classify(e: BaseException) -> tuple[int, str]:
    """An import refused over the frame link: the status and message the HTTP route would answer."""
    if isinstance(e, TransferError):
        return STATUS.get(type(e), 409), str(e)
    if isinstance(e, HTTPError):
        return e.status, e.message
    if isinstance(e, RestoreError):
        return 409, str(e)
    if isinstance(e, EngineDeadError):  # as the replica's HTTP face answers it
        return 503, str(e)
    if isinstance(e, StorageError):
        return 400, f"{type(e).__name__}: {e}"
    return 500, f"{type(e).__name__}: {e}"


async def restore_sessions(ops: EngineOps, body: RestoreBody) -> dict:
    """POST /v1/sessions/restore: a checkpoint's sessions placed on this replica."""
    check_ids(body.sessions)
    base, cid = split_checkpoint_uri(body.checkpoint)
    reader = await asyncio.to_thread(CheckpointReader, _open_store(base), cid)
    # cheap refusals first (model, geometry, ids, room): the sizes a manifest declares are
    # bounded by what this replica can hold before any chunk is fetched or decoded; then every hash
    ids, conv = await ops.restore(reader, body.sessions, body.exact)
    return {"sessions": ids, "converted": conv, "recomputed": await ops.load_outcomes(ids)}


async def checkpoint_sessions(ops: EngineOps, aengine: AsyncEngine, table: TransferTable, body: CheckpointBody
                              ) -> dict:
    """POST /v1/sessions/checkpoint: the sessions written to a store (with `stop`: released here once committed)."""
    engine_name = aengine.engine.engine_name
    check_ids(body.sessions)
    cid = check_id(body.checkpoint_id or new_checkpoint_id(), "checkpoint id")
    busy = table.migrating_out()
    if body.stop and busy:
        raise HTTPError(409, f"a migration (transfer {busy}) is in flight on this replica")
    dest = body.destination or allowed_roots()[0].joinpath("checkpoints").as_uri()
    store = _open_store(dest)

    try:
        cut = await ops.take_checkpoint(body.sessions, body.stop)
    except KeyError as e:
        raise HTTPError(404, str(e.args[0])) from None
    ids = [s.session_id for s in cut.snaps]

    def write():
        with CheckpointWriter(store, cid, codec=body.codec) as w:
            write_snapshot(cut.snaps, w)
            w.commit(cut.model, cut.layout, cut.geometry, {"stop": body.stop, "engine": engine_name})
            return w.bytes_written

    try:
        nbytes = await asyncio.to_thread(write)
    except BaseException as e:
        if body.stop:
            try:  # nothing committed: the source keeps serving
                await aengine.call(lambda e: e.resume(ids))
            except Exception:  # noqa: BLE001 - a dead engine has nothing left to resume
                pass
        if isinstance(e, (StorageError, HTTPError)) or not isinstance(e, Exception):
            raise
        # the store failed (disk full, S3 gone): a clear error, never a stack trace
        raise HTTPError(502, f"checkpoint {cid} was not written to {dest}: {type(e).__name__}: {e}; "
                             f"nothing was committed" + ("; the sessions continue here" if body.stop else "")
                        ) from None
    uri = f"{dest.rstrip('/')}/{cid}"
    if body.stop:  # their streams end with finish_reason "checkpointed"; GET /v1/sessions/{id} names the URI
        aengine.note_checkpointed(ids, uri)
        await aengine.call(lambda e: e.release(ids, SessionStatus.CHECKPOINTED))
    return {"checkpoint": uri, "checkpoint_id": cid, "sessions": ids, "bytes": nbytes,
            "not_moved": cut.not_moved}


async def export_sessions(table: TransferTable, transports: dict[str, Transport], transport: Transport,
                          body: ExportBody) -> StreamingResponse:
    """POST /v1/sessions/export: a round's frames, streamed to the caller or pushed to `body.target`
    (over `body.transport`, else `transport`) with its progress streamed back."""
    check_id(body.transfer, "transfer id")
    check_ids(body.sessions)
    for url in (body.target, body.source):
        if url is not None and not URL_RE.fullmatch(url):
            raise HTTPError(400, "target and source must be replica http(s) URLs")
    chosen = transports[body.transport] if body.transport else transport
    if isinstance(chosen, MooncakeTransport) and body.target is not None and (why := mooncake_unavailable()):
        raise HTTPError(400, f"transport mooncake is not available on this replica: {why}")
    options = FrameOptions()  # the transport chooses them before the first frame is made
    frames = await table.export(body.transfer, body.sessions, body.pause, body.codec, body.max_tokens, body.have,
                                confirm_on_delivery=body.target is not None, options=options)
    if body.target is None:
        return StreamingResponse(frames, media_type="application/x-relayout-frames")
    # push: only this transfer's frames, only to the import route of a URL an authenticated caller gave
    counter = [0]
    send = chosen.push(body.target, body.transfer, RoundFrames(frames, None if body.pause else precopy_mbps(),
                                                                  counter=counter, background=not body.pause,
                                                                  options=options, inline=table.in_place(body.transfer),
                                                                  header=table.round_header(body.transfer)),
                          final=body.pause, source=body.source, timeout_s=body.timeout_s)
    return StreamingResponse(progress_stream(table.push(body.transfer, send), counter,
                                             min(1.0, body.timeout_s / 4), table.not_moved(body.transfer)),
                             media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    """The protocol's refusals as HTTP answers: a transfer's (409 unless mapped), a restore's, a store's."""
    @app.exception_handler(TransferError)
    async def _transfer_error(_: Request, e: TransferError):
        return error_response(STATUS.get(type(e), 409), str(e))

    @app.exception_handler(RestoreError)
    async def _restore_error(_: Request, e: RestoreError):
        return error_response(409, str(e), "conflict")

    @app.exception_handler(StorageError)
    async def _storage_error(_: Request, e: StorageError):
        return error_response(400, f"{type(e).__name__}: {e}", "checkpoint_error")


@dataclass
class ReplicaMoves:
    """What the session-moving routes act on (the app's `state.moves`): the engine and its operations,
    the replica's transfer table, the transports a round may be pushed by, the frame link's server."""

    aengine: AsyncEngine
    ops: EngineOps
    table: TransferTable
    transports: dict[str, Transport]
    transport: Transport  # the default (RELAYOUT_TRANSPORT)
    link: FrameLinkServer


async def moves(request: Request) -> ReplicaMoves:
    # async: FastAPI runs a plain-def dependency on its thread pool, a thread hop per request
    return request.app.state.moves


router = APIRouter()  # mounted behind the replica's bearer check by install_replica_routes


@router.post("/v1/sessions/checkpoint")
async def checkpoint_route(body: CheckpointBody, m: ReplicaMoves = Depends(moves)):
    return await checkpoint_sessions(m.ops, m.aengine, m.table, body)


@router.post("/v1/sessions/restore")
async def restore_route(body: RestoreBody, m: ReplicaMoves = Depends(moves)):
    return await restore_sessions(m.ops, body)


@router.post("/v1/sessions/export")
async def export_route(body: ExportBody, m: ReplicaMoves = Depends(moves)):
    return await export_sessions(m.table, m.transports, m.transport, body)


@router.post(IMPORT_PATH)
async def import_route(request: Request, transfer: str, final: bool = False, source: str | None = None,
                       m: ReplicaMoves = Depends(moves)):
    check_id(transfer, "transfer id")
    if source is not None and (len(source) > 2048 or not URL_RE.fullmatch(source)):
        raise HTTPError(400, "source must be the source replica's http(s) URL")
    cl = request.headers.get("content-length")
    declared = int(cl) if cl is not None and cl.isdigit() else None
    try:
        return await m.table.import_round(transfer, _cut_pieces(request), final, source, declared)
    except RoundCut:
        raise ClientDisconnect() from None


@router.get(LINK_PATH)
async def link_route(request: Request, m: ReplicaMoves = Depends(moves)):
    """The port of this replica's raw frame link (migrate.transport.frame_link), listening on the address
    this request arrived on."""
    host = (request.scope.get("server") or ("127.0.0.1", 0))[0]
    port = await m.link.ensure(host)
    return link_address(port, entries=m.ops.places_on_arrival)  # (a vLLM replica's import stages every chunk)


@router.post("/v1/sessions/transfers/{transfer}/commit")
async def commit_incoming(transfer: str, m: ReplicaMoves = Depends(moves)):
    """Target: the source has released the sessions; they run here from now on."""
    return await m.table.commit(check_id(transfer, "transfer id"))


@router.get("/v1/sessions/transfers/{transfer}")
async def transfer_state(transfer: str, m: ReplicaMoves = Depends(moves)):
    return m.table.state(check_id(transfer, "transfer id"))


@router.delete("/v1/sessions/transfers/{transfer}")
async def abort_transfer(transfer: str, m: ReplicaMoves = Depends(moves)):
    await m.table.abort(check_id(transfer, "transfer id"))
    return {"aborted": transfer}


@router.post("/v1/sessions/release")
async def release_route(body: SessionsBody, m: ReplicaMoves = Depends(moves)):
    """Source, two-phase commit: the target holds the sessions now; free them here. With
    `transfer`, refused (409) unless that transfer is still live here (not expired)."""
    check_ids(body.sessions)
    if body.transfer is not None:
        check_id(body.transfer, "transfer id")
    await m.table.release(body.sessions, body.transfer, body.migrated_to)
    return {"sessions": body.sessions}


@router.post("/v1/sessions/resume")
async def resume_route(body: SessionsBody, m: ReplicaMoves = Depends(moves)):
    check_ids(body.sessions)
    await m.aengine.call(lambda e: e.resume(body.sessions))
    return {"sessions": body.sessions}


def install_replica_routes(app: FastAPI, aengine: AsyncEngine, token: str | None = None) -> TransferTable:
    """Mount the session-moving routes on a replica's app; returns the replica's TransferTable."""
    token = token if token is not None else env_token()
    ops = engine_ops_for(aengine, defer_copy=True)  # builtin or vLLM: the only place that differs
    import_limit, frame_limit = ops.import_limits(aengine.engine)
    table = TransferTable(ops, source_asker(token), import_limit=import_limit, frame_limit=frame_limit)
    # chosen per export (`transport`, default RELAYOUT_TRANSPORT); tcp and mooncake push https targets over HTTP
    http_transport = HttpTransport(token)
    transports: dict[str, Transport] = {"http": http_transport, "tcp": TcpTransport(token, http_transport, PushFailed),
                                        "mooncake": MooncakeTransport(token, http_transport)}
    link = FrameLinkServer(token, table.import_link_round, _classify, check_id, RoundCut)
    app.state.moves = ReplicaMoves(aengine, ops, table, transports, transports[settings().transport], link)
    app.state.mooncake = MooncakeReceiver(table.import_round, _classify)
    r = APIRouter(dependencies=[Depends(bearer_auth(token))])
    r.include_router(router)
    r.include_router(mooncake_router)
    app.include_router(r)
    app.state.body_limits.bound(lambda path: path.startswith("/v1/sessions/") and path != IMPORT_PATH, MAX_JSON_BODY)
    install_error_handlers(app)
    return table
