"""Replica routes that move sessions: checkpoint to a store, restore from one, and the
live-transfer rounds (export frames on the source, import frames on the target).

A live transfer is the same manifest + chunks as a checkpoint, framed (storage.stream):
each round streams only chunks the target lacks plus a cumulative manifest. These routes
need the replica's bearer token when it has one (RELAYOUT_TOKEN)."""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import re
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from relayout.engine.async_engine import AsyncEngine
from relayout.engine.engine import LLMEngine
from relayout.engine.snapshot import (
    CHUNK_TOKENS,
    IncomingTransfer,
    OutgoingTransfer,
    RestoreError,
    abort_incoming,
    check_compatible,
    geometry,
    model_ref,
    new_checkpoint_id,
    plan_restore,
    receive_round,
    release,
    restore,
    take_snapshot,
    write_snapshot,
)
from relayout.engine.workers import RankFailure
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.errors import StorageError
from relayout.storage.store_base import Store
from relayout.storage.stores import MemoryStore, open_store
from relayout.storage.stream import (
    StreamReceiver,
    encode_abort_frame,
    encode_chunk_frame,
    encode_raw_manifest_frame,
)
from starlette.requests import ClientDisconnect

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SOURCE_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/\-]*)?$")
MAX_TRANSFERS = 64
MAX_BODY = 1 << 20  # JSON bodies of the session routes (the import route streams and has its own bound)
DONE_KEEP = 1024  # finished transfers remembered (for a target that asks how one ended)


def transfer_ttl() -> float:
    """Seconds a live transfer may sit idle before the replica decides it alone (its migrator is gone)."""
    try:
        return max(0.5, float(os.environ.get("RELAYOUT_TRANSFER_TTL_S", "60")))
    except ValueError:
        return 60.0


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
        # the writer just built and validated these bytes: no need to parse them again
        self.frames.append(encode_raw_manifest_frame(checkpoint_id, data))

    def pin(self, h: str) -> None:
        pass

    def unpin(self, hashes) -> None:
        pass


class SinkWriter(CheckpointWriter):
    """CheckpointWriter that tells the FrameSink each chunk's reference before putting it."""

    def put_kv(self, session_id, layer, head_lo, head_hi, tok_lo, tok_hi, tensor):  # type: ignore[override]
        from relayout.storage.chunks import pack_kv
        from relayout.storage.manifest import KVEntry

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


@dataclass
class _Out:
    """Source-side bookkeeping of one outgoing transfer (the lease)."""

    t: OutgoingTransfer
    last: float = field(default_factory=time.monotonic)
    busy: int = 0  # export streams in progress (never expired under them)
    paused: list[str] = field(default_factory=list)  # held by a final round, until release or resume


@dataclass
class _In:
    """Target-side bookkeeping of one incoming transfer."""

    t: IncomingTransfer
    source: str | None = None
    last: float = field(default_factory=time.monotonic)
    busy: int = 0
    staged: int = 0  # bytes received into the staging store, all rounds together
    final: bool = False  # the final round was imported: the sessions are placed, held until commit
    first_doubt: float | None = None


class _BodyLimit:
    """ASGI middleware: JSON bodies of /v1/sessions/* routes are at most MAX_BODY bytes (413),
    read before the route runs; the streamed import route is bounded by its own limit."""

    def __init__(self, app, limit: int = MAX_BODY):
        self.app, self.limit = app, limit

    async def _too_large(self, send) -> None:
        body = json.dumps({"error": {"message": f"request body over {self.limit} bytes", "type": "invalid_request_error",
                                     "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if (not path.startswith("/v1/sessions/") or path == "/v1/sessions/import"
                or scope.get("method") not in ("POST", "PUT", "PATCH")):
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    if int(v) > self.limit:
                        return await self._too_large(send)
                except ValueError:
                    pass  # the server itself refuses a malformed content-length
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > self.limit:
                return await self._too_large(send)
            if not msg.get("more_body", False):
                break
        done = False

        async def replay():
            nonlocal done
            if not done:
                done = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


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
    # pre-copy rounds: at most this many tokens per session (bounds the engine thread's copy)
    max_tokens: int | None = Field(None, ge=16, le=1 << 24)
    # retry of an interrupted round: chunks the target acknowledged (holds); only the rest are sent
    have: list[str] | None = Field(None, max_length=1 << 20)


class SessionsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sessions: list[str] = Field(..., max_length=4096)
    migrated_to: str | None = Field(None, max_length=2048)
    transfer: str | None = Field(None, max_length=128)  # release: the commit of this transfer (refused if expired)


def _import_limits(engine: LLMEngine) -> tuple[int, int]:
    """(bytes one incoming transfer may stage, all rounds together; largest frame). A transfer
    can never need more than the KV this replica could hold, so a stream that declares or
    sends more is refused before it is buffered."""
    from relayout.engine.kv_cache import BLOCK_SIZE
    from relayout.storage.manifest import MAX_MANIFEST_BYTES

    c = engine.cfg
    item = torch_itemsize(engine.dtype)
    tokens = engine.num_blocks * BLOCK_SIZE * engine.layout.attn_dp
    kv_bytes = tokens * c.num_layers * 2 * c.num_kv_heads * c.head_dim * item
    chunk = 2 * c.num_kv_heads * CHUNK_TOKENS * c.head_dim * item + (64 << 10)
    frame = max(MAX_MANIFEST_BYTES, 2 * chunk) + (1 << 20)
    limit = 2 * kv_bytes + MAX_MANIFEST_BYTES
    env = os.environ.get("RELAYOUT_MAX_IMPORT_BYTES")
    if env and env.isdigit():
        limit = int(env)
    return limit, min(frame, limit)


def torch_itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _precheck_restore(engine: LLMEngine, manifest, sessions: list[str] | None) -> None:
    """Refusals that need no chunk: model, geometry, ids, room, and KV no longer than the
    session's tokens (so no declared size can make verify() decode more than the replica holds)."""
    from relayout.engine.session import SessionState
    from relayout.storage.errors import CorruptCheckpoint

    check_compatible(engine, manifest)
    plan_restore(engine, manifest, sessions)
    for e in manifest.sessions:
        if sessions is None or e.session_id in sessions:
            n = SessionState.from_dict(e.state).num_tokens
            if e.num_kv_tokens > n:
                raise CorruptCheckpoint(f"session {e.session_id} declares {e.num_kv_tokens} KV tokens but holds "
                                        f"only {n} tokens")


def install_session_routes(app: FastAPI, aengine: AsyncEngine, token: str | None = None) -> None:
    token = token if token is not None else os.environ.get("RELAYOUT_TOKEN") or None
    outgoing: dict[str, _Out] = {}
    incoming: dict[str, _In] = {}
    out_done: OrderedDict[str, str] = OrderedDict()  # transfer -> released | aborted | expired
    in_done: OrderedDict[str, str] = OrderedDict()  # transfer -> committed | aborted | expired
    sweeper: list[asyncio.Task] = []
    import_limit, frame_limit = _import_limits(aengine.engine)

    async def ecall(fn):
        """aengine.call; a rank that died under it takes the replica down (503 from now on),
        as a failed step would, instead of leaving it reporting healthy with no executor."""
        try:
            return await aengine.call(fn)
        except RankFailure as e:
            aengine._fail(e)
            raise aengine._dead() from None

    def auth(request: Request) -> None:
        if token is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise RouteError(401, "missing or wrong bearer token")

    def _remember(done: OrderedDict[str, str], tid: str, state: str) -> None:
        done[tid] = state
        done.move_to_end(tid)
        while len(done) > DONE_KEEP:
            done.popitem(last=False)

    async def _resume(ids: list[str]) -> None:
        if ids:
            try:
                await ecall(lambda e: e.resume(ids))
            except Exception:  # noqa: BLE001 - a dead engine has nothing left to resume
                pass

    async def end_outgoing(tid: str, state: str) -> None:
        """Source: forget the transfer; sessions it paused and nobody released run here again."""
        o = outgoing.pop(tid, None)
        if o is None:
            return
        _remember(out_done, tid, state)
        await _resume(o.paused)

    async def drop_incoming(tid: str, state: str) -> None:
        """Target: free the reservations and uncommitted sessions of a transfer."""
        i = incoming.pop(tid, None)
        if i is None:
            return
        _remember(in_done, tid, state)
        try:
            await ecall(lambda e: abort_incoming(e, i.t))
        except Exception:  # noqa: BLE001 - a dead engine holds nothing any more
            pass

    async def commit_incoming_now(tid: str) -> list[str]:
        i = incoming.pop(tid)
        t = i.t
        _remember(in_done, tid, "committed")

        def commit(e: LLMEngine) -> None:
            t.placed, placed = [], t.placed  # committed: abort_incoming must only free spare reservations
            abort_incoming(e, t)
            e.resume(placed)
            t.placed = placed

        await ecall(commit)
        return list(t.placed)

    async def ask_source(tid: str, i: _In) -> str | None:
        """In doubt (placed, no commit, the migrator gone): how did the source end the transfer?
        "commit", "abort", or None (no answer yet)."""
        if i.source is None:
            return "abort"  # nobody to ask: the source's lease expired and it resumed them
        import httpx

        try:
            async with httpx.AsyncClient(timeout=5.0) as c:
                resp = await c.get(f"{i.source.rstrip('/')}/v1/sessions/transfers/{tid}",
                                   headers={"Authorization": f"Bearer {token}"} if token else {})
            if resp.status_code != 200:
                return None
            state = resp.json().get("outgoing")
        except Exception:  # noqa: BLE001 - unreachable, or not a replica: keep asking
            return None
        if state == "released":
            return "commit"
        if state is None:
            return "commit"  # the source restarted: it lost the sessions, this copy is the only one
        if state in ("aborted", "expired"):
            return "abort"
        return None  # still active on the source

    async def sweep_once() -> None:
        now, ttl = time.monotonic(), transfer_ttl()
        for tid, o in list(outgoing.items()):
            if now - o.last > ttl:
                await end_outgoing(tid, "expired")
        for tid, i in list(incoming.items()):
            if now - i.last <= ttl:
                continue
            if not i.final:
                await drop_incoming(tid, "expired")
                continue
            if now - i.last <= 2 * ttl:  # by then the source has either released or resumed them
                continue
            i.first_doubt = i.first_doubt or now
            verdict = await ask_source(tid, i)
            if tid not in incoming:
                continue
            if verdict == "commit":
                await commit_incoming_now(tid)
            elif verdict == "abort" or now - i.first_doubt > 10 * ttl:
                await drop_incoming(tid, "expired")

    async def sweep_loop() -> None:
        while outgoing or incoming:
            await asyncio.sleep(min(1.0, transfer_ttl() / 4))
            try:
                await sweep_once()
            except Exception:  # noqa: BLE001 - keep sweeping
                pass

    def ensure_sweeper() -> None:
        if not sweeper or sweeper[0].done():
            sweeper[:] = [asyncio.get_running_loop().create_task(sweep_loop())]

    r = APIRouter(dependencies=[Depends(auth)])

    @r.post("/v1/sessions/checkpoint")
    async def checkpoint_route(body: CheckpointBody):
        check_ids(body.sessions)
        cid = body.checkpoint_id or new_checkpoint_id()
        check_ids([cid], "checkpoint id")
        if body.stop and outgoing:
            raise RouteError(409, f"a migration (transfer {next(iter(outgoing))}) is in flight on this replica")
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
            snaps, mref, lay, geo = await ecall(cut)
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
        except BaseException as e:
            if body.stop:
                await _resume(ids)  # nothing committed: the source keeps serving
            if isinstance(e, (StorageError, RouteError)) or not isinstance(e, Exception):
                raise
            # the store failed (disk full, S3 gone): a clear error, never a stack trace
            raise RouteError(502, f"checkpoint {cid} was not written to {dest}: {type(e).__name__}: {e}; "
                                  f"nothing was committed" + ("; the sessions continue here" if body.stop else "")) from None
        if body.stop:
            await ecall(lambda e: release(e, ids))
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
        # cheap refusals first (model, geometry, ids, room): the sizes a manifest declares are
        # bounded by what this replica can hold before any chunk is fetched or decoded
        await ecall(lambda e: _precheck_restore(e, reader.manifest, body.sessions))
        await asyncio.to_thread(reader.verify)  # hashes checked before the engine is touched
        ids = await ecall(lambda e: restore(e, reader, body.sessions, verify=False))
        return {"sessions": ids}

    @r.post("/v1/sessions/export")
    async def export_route(body: ExportBody):
        check_ids([body.transfer], "transfer id")
        check_ids(body.sessions)
        o = outgoing.get(body.transfer)
        if o is None:
            if body.transfer in out_done:
                raise RouteError(409, f"transfer {body.transfer} already ended ({out_done[body.transfer]})")
            if outgoing:
                raise RouteError(409, f"this replica is already migrating out (transfer {next(iter(outgoing))}): "
                                      "one outgoing migration at a time")
            o = outgoing[body.transfer] = _Out(OutgoingTransfer(body.transfer))
            ensure_sweeper()
        if o.paused:
            raise RouteError(409, f"transfer {body.transfer} already ran its final round")
        o.last = time.monotonic()
        t = o.t
        sent = dict(t.sent_upto)
        if body.have is not None:
            # the previous round was cut: what it sent may not have arrived; resend all but the
            # chunks of committed rounds and those the target says it holds
            t.sent_hashes.clear()
            t.sent_hashes.update(e.chunk.hash for e in t.entries)
            t.sent_hashes.update(h for h in body.have if isinstance(h, str) and len(h) == 32)

        def cut(e: LLMEngine):
            paused: list[str] = []
            if body.pause:
                if body.sessions is None:
                    paused = [s.session_id for s in e.sessions.values() if not s.is_finished]
                else:
                    for sid in body.sessions:
                        if sid not in e.sessions:
                            raise KeyError(f"session {sid} is not on this replica")
                    # one that finished since the last round has nothing left to move
                    paused = [sid for sid in body.sessions if not e.sessions[sid].is_finished]
                e.pause(paused)
            snaps = take_snapshot(e, paused if body.pause else body.sessions, sent,
                                  None if body.pause else body.max_tokens)
            return paused, snaps, model_ref(e), e.layout.to_dict(), geometry(e)

        try:
            paused, snaps, mref, lay, geo = await ecall(cut)
        except KeyError as e:
            raise RouteError(404, str(e.args[0])) from None
        if outgoing.get(body.transfer) is not o:  # expired or aborted meanwhile: give them back
            await _resume(paused)
            raise RouteError(409, f"transfer {body.transfer} ended while its round was cut")
        o.paused = paused
        t.rounds += 1

        def frames() -> Iterator[bytes]:
            try:
                sink = FrameSink(t.sent_hashes)
                w = SinkWriter(sink, f"{body.transfer}-r{t.rounds}", codec=body.codec)
                # earlier rounds' chunks, of the sessions still moving (one that finished since
                # has no entry in this manifest; the target frees its reservation)
                moving = {snap.state.session_id for snap in snaps}
                w.carry([e for e in t.entries if e.session_id in moving])
                for snap in snaps:
                    write_snapshot([snap], w, sent)
                    o.last = time.monotonic()
                    yield from sink.frames
                    sink.frames.clear()
                m = w.commit(mref, lay, geo, {"transfer": body.transfer, "round": t.rounds, "final": body.pause})
            except Exception as e:  # noqa: BLE001 - tell the receiver why, in-band, instead of a torn stream
                yield encode_abort_frame(f"source failed to export round {t.rounds}: {type(e).__name__}: {e}")
                return
            t.entries = list(m.kv_entries)
            for snap in snaps:
                t.sent_upto[snap.state.session_id] = snap.num_kv_tokens
            o.last = time.monotonic()
            yield from sink.frames

        return StreamingResponse(frames(), media_type="application/x-relayout-frames")

    @r.post("/v1/sessions/import")
    async def import_route(request: Request, transfer: str, final: bool = False, source: str | None = None):
        check_ids([transfer], "transfer id")
        if source is not None and (len(source) > 2048 or not SOURCE_RE.fullmatch(source)):
            raise RouteError(400, "source must be the source replica's http(s) URL")
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > import_limit:
            raise RouteError(413, f"transfer round of {cl} bytes exceeds this replica's import limit of {import_limit}")
        i = incoming.get(transfer)
        if i is None:
            if transfer in in_done:
                raise RouteError(409, f"transfer {transfer} already ended ({in_done[transfer]})")
            if len(incoming) >= MAX_TRANSFERS:
                raise RouteError(429, "too many transfers in flight")
            i = incoming[transfer] = _In(IncomingTransfer(transfer, MemoryStore()), source)
            ensure_sweeper()
        elif i.final:
            raise RouteError(409, f"transfer {transfer} already ran its final round")
        i.last = time.monotonic()
        recv = StreamReceiver(i.t.store, max_frame_bytes=frame_limit)  # type: ignore[arg-type]
        try:
            async for piece in request.stream():
                if piece:
                    i.staged += len(piece)
                    i.last = time.monotonic()
                    if i.staged > import_limit:
                        raise RouteError(413, f"transfer {transfer} sent more than this replica's import limit "
                                              f"of {import_limit} bytes")
                    recv.feed(piece)
            manifest = recv.close()
            res = await ecall(lambda e: receive_round(e, i.t, manifest, final))
        except ClientDisconnect:
            if final:
                await asyncio.shield(drop_incoming(transfer, "aborted"))
                raise
            # the link was cut mid pre-copy round: keep what arrived (chunks verified on receipt)
            # and the reservations, so the migrator can resume from the acknowledged chunks; the
            # transfer's lease frees everything if it never comes back
            i.last = time.monotonic()
            raise
        except BaseException:
            # a garbled or refused round: nothing stays reserved for it
            await asyncio.shield(drop_incoming(transfer, "aborted"))
            raise
        i.last = time.monotonic()
        if final:
            i.final = True
            res["placed"] = list(i.t.placed)
        return res

    @r.post("/v1/sessions/transfers/{transfer}/commit")
    async def commit_incoming(transfer: str):
        """Target: the source has released the sessions; they run here from now on."""
        check_ids([transfer], "transfer id")
        if transfer not in incoming:
            if in_done.get(transfer) == "committed":
                return {"sessions": [], "already": "committed"}
            raise RouteError(404 if transfer not in in_done else 409,
                             f"no incoming transfer {transfer!r}" + (f" ({in_done[transfer]})" if transfer in in_done else ""))
        if not incoming[transfer].final:
            raise RouteError(409, f"transfer {transfer} has not run its final round")
        return {"sessions": await commit_incoming_now(transfer)}

    @r.get("/v1/sessions/transfers/{transfer}")
    async def transfer_state(transfer: str):
        """How this replica sees a transfer: outgoing active|paused|released|aborted|expired,
        incoming receiving|placed|committed|aborted|expired (null: unknown here)."""
        check_ids([transfer], "transfer id")
        o, i = outgoing.get(transfer), incoming.get(transfer)
        return {"transfer": transfer,
                "outgoing": ("paused" if o.paused else "active") if o else out_done.get(transfer),
                "incoming": ("placed" if i.final else "receiving") if i else in_done.get(transfer),
                "placed": list(i.t.placed) if i else [],
                # chunks held (verified), so an interrupted round resumes after them
                "chunks": sorted(i.t.store.chunk_hashes()) if i else []}

    @r.delete("/v1/sessions/transfers/{transfer}")
    async def abort_transfer(transfer: str):
        """Either side: forget the transfer; the source resumes what it paused and did not
        release, the target frees reservations and uncommitted sessions."""
        check_ids([transfer], "transfer id")
        await end_outgoing(transfer, "aborted")
        await drop_incoming(transfer, "aborted")
        return {"aborted": transfer}

    @r.post("/v1/sessions/release")
    async def release_route(body: SessionsBody):
        """Source, two-phase commit: the target holds the sessions now; free them here. With
        `transfer`, refused (409) unless that transfer is still live here (not expired)."""
        check_ids(body.sessions)
        if body.transfer is not None:
            check_ids([body.transfer], "transfer id")
            if body.transfer not in outgoing:
                raise RouteError(409, f"transfer {body.transfer} is {out_done.get(body.transfer, 'unknown')} on the "
                                      "source: not released, the sessions stay here")
            outgoing.pop(body.transfer)  # no await since the check: the sweeper cannot expire it in between
            _remember(out_done, body.transfer, "released")
        for sid in body.sessions:
            if body.migrated_to:
                aengine.migrated_to[sid] = body.migrated_to
        await ecall(lambda e: release(e, body.sessions))
        return {"sessions": body.sessions}

    @r.post("/v1/sessions/resume")
    async def resume_route(body: SessionsBody):
        check_ids(body.sessions)
        await ecall(lambda e: e.resume(body.sessions))
        return {"sessions": body.sessions}

    app.include_router(r)
    app.add_middleware(_BodyLimit)

    @app.exception_handler(RouteError)
    async def _route_error(_: Request, e: RouteError):
        from relayout.engine.server import error_response

        return error_response(e.status, e.message, "invalid_request_error" if e.status < 500 else "server_error")

    @app.exception_handler(RestoreError)
    async def _restore_error(_: Request, e: RestoreError):
        from relayout.engine.server import error_response

        return error_response(409, str(e), "conflict")

    @app.exception_handler(StorageError)
    async def _storage_error(_: Request, e: StorageError):
        from relayout.engine.server import error_response

        return error_response(400, f"{type(e).__name__}: {e}", "checkpoint_error")
