"""Live-migration rounds over Mooncake's transfer engine (`pip install relayout[mooncake]`), the
export's `"transport": "mooncake"` or RELAYOUT_TRANSPORT=mooncake (docs/protocol.md).

Mooncake writes one-sided into memory a peer registered, so the round is steered over the
target's authenticated HTTP routes (MOONCAKE_PATH, the replica's bearer token); only bytes take Mooncake:

    POST .../open?transfer=T&final=F&source=S  the target registers a receive ring (SLOTS slots) for this
                                               round only: {session: host:rpc_port, addr, size, slots}
    (Mooncake write)                           the source writes the round's frames (the bytes HTTP would
                                               carry) into slot k of that ring
    POST .../segment?transfer=T&seq=N&slot=k&length=n   the target feeds slot k to the round's import
                                               (TransferTable.import_round); answered: slot k is free
    POST .../end?transfer=T                    the import's reply; the ring is unregistered by then
    POST .../cut?transfer=T                    (a failed push) the round is cut: kept for a resume

Hash checks, leases and the two-phase commit stay the import's. Mooncake's ports listen on every
interface without authentication, so memory is registered only while an authenticated round runs
(the target's ring, the source's staging ring). One engine per process, started on first use
(P2PHANDSHAKE: no metadata server), rebuilt after a failed write (which can poison the connection)."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter, Depends, Request
from relayout.engine.web import URL_RE, HTTPError, bearer_headers, check_id, error_message, tls_context
from relayout.migrate.transport.base import PushFailed, RoundCut, RoundFrames
from relayout.storage.settings import settings

MOONCAKE_PATH = "/v1/sessions/import/mooncake"
SLOTS = 4  # ring slots: the source fills and writes one while the target imports another
ENTRY_BYTES = 16 << 20  # one batch entry (larger entries moved faster over TCP here); far under ~2000 per batch
MAX_BATCH = 1024  # more entries per batch are refused by Mooncake and can poison the connection
MAX_RECEIVES = 4  # rounds this replica receives over Mooncake at once (each holds one ring)
KEEP_ENDED_S = 60.0  # an ended round's outcome is kept this long for its source's next call
DISABLE_ENV = "RELAYOUT_MOONCAKE_DISABLED"  # "1": behave as if Mooncake were not installed (tests, ops)

ImportRound = Callable[..., Awaitable[dict]]  # TransferTable.import_round
Classify = Callable[[BaseException], tuple[int, str]]


def ring_bytes() -> int:
    """RELAYOUT_MOONCAKE_BUFFER_MB (default 64, 1–1024): the receive ring of one round."""
    return settings().mooncake_buffer_mb << 20


def unavailable() -> str | None:
    """Why Mooncake cannot be used in this process, or None when it can."""
    if settings().mooncake_disabled:
        return f"disabled on this replica ({DISABLE_ENV})"
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ModuleNotFoundError:
        return "the mooncake package is not installed (pip install 'relayout[mooncake]')"
    except ImportError as e:
        if "ibverbs" in str(e):
            return f"the system library libibverbs is missing (apt-get install libibverbs1): {e}"
        return f"mooncake cannot be imported: {e}"
    return None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(f"mooncake {what} failed (return code {rc})")


class _Engine:
    """The process's TransferEngine: started on first use, dropped after a failure (a poisoned
    connection is not reused); a registration keeps a reference to the engine it was made on."""

    def __init__(self) -> None:
        self.engine = None
        self.session = ""
        self.lock = threading.Lock()

    def get(self, host: str) -> tuple[object, str]:
        with self.lock:
            if self.engine is None:
                from mooncake.engine import TransferEngine

                e = TransferEngine()
                host = settings().mooncake_host or host
                _check(e.initialize(host, "P2PHANDSHAKE", "tcp", ""), "initialize")
                self.engine, self.session = e, f"{host}:{e.get_rpc_port()}"
            return self.engine, self.session

    def discard(self, engine: object) -> None:
        with self.lock:
            if self.engine is engine:
                self.engine = None


ENGINE = _Engine()


class _Ring:
    """Anonymous memory (page-aligned, not zero-filled by us), kept for reuse between rounds;
    registered with an engine only while a round uses it."""

    free: list[_Ring] = []
    stuck: list[_Ring] = []  # still registered (unregister failed): kept alive, never reused
    free_lock = threading.Lock()

    def __init__(self, size: int):
        self.size = size
        self.mem = mmap.mmap(-1, size)
        self.view = memoryview(self.mem)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        self.engine: object | None = None

    @classmethod
    def take(cls, size: int) -> _Ring:
        with cls.free_lock:
            for r in cls.free:
                if r.size == size:
                    cls.free.remove(r)
                    return r
        return cls(size)

    def register(self, engine: object) -> None:
        _check(engine.register_memory(self.addr, self.size), "register_memory")  # type: ignore[attr-defined]
        self.engine = engine

    def release(self) -> None:
        """Unregister (nothing can write here any more), then keep the memory for the next round. A
        ring Mooncake failed to unregister is never reused nor freed: a peer may still write into it."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            if engine.unregister_memory(self.addr) != 0:  # type: ignore[attr-defined]
                with self.free_lock:
                    self.stuck.append(self)
                return
        with self.free_lock:
            if len(self.free) < 2:
                self.free.append(self)


# ---- target -----------------------------------------------------------------------------------------
@dataclass
class _Receive:
    transfer: str
    ring: _Ring
    slots: int
    timeout_s: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    seq: int = 0  # the next segment expected
    closed: bool = False
    ended: float | None = None  # monotonic time the import ended

    def close(self) -> None:
        """Unregister the ring (once: a ring must not go back to the pool twice)."""
        if not self.closed:
            self.closed = True
            self.ring.release()

    async def pieces(self) -> AsyncIterator[bytes]:
        """The round's bytes, segment by segment; each is copied out of the ring (so its slot is
        free again at once) before the import parses it."""
        slot = self.ring.size // self.slots
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self.queue.get(), self.timeout_s)
                except asyncio.TimeoutError:
                    raise RoundCut() from None  # the source went silent: a cut round, kept for a resume
                if item is None:
                    return
                if isinstance(item, RoundCut):
                    raise item
                k, n, done = item
                piece = bytes(self.ring.view[k * slot:k * slot + n])
                if not done.done():
                    done.set_result(None)
                yield piece
        finally:
            self.close()  # the last byte is out: nothing may be written here any more (unregistering is cheap)


class MooncakeReceiver:
    """The target's Mooncake rounds, one per transfer: the ring each writes into and the import it feeds."""

    def __init__(self, import_round: ImportRound, classify: Classify) -> None:
        self.import_round, self.classify = import_round, classify
        self.receives: dict[str, _Receive] = {}

    def fail(self, e: BaseException) -> HTTPError:
        if isinstance(e, RoundCut):
            return HTTPError(408, "the round was cut (the source went silent)")
        status, msg = self.classify(e)
        return HTTPError(status, msg)

    async def outcome(self, rx: _Receive, waiting: asyncio.Future | None = None) -> dict | None:
        """Wait for `waiting` (a segment taken) or the import's end; raise the import's refusal."""
        assert rx.task is not None
        done, _ = await asyncio.wait({rx.task} | ({waiting} if waiting else set()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if waiting is not None and waiting in done:
            return None
        try:
            return rx.task.result()
        except asyncio.CancelledError:
            raise HTTPError(409, "the round was superseded") from None
        except Exception as e:  # noqa: BLE001 - the import's refusal, as the HTTP import route answers it
            raise self.fail(e) from None

    async def run(self, rx: _Receive, final: bool, source: str | None) -> dict:
        # an ended round stays listed (its outcome answers the source's next segment or end) until
        # its end or cut is asked, the transfer opens another round, or KEEP_ENDED_S passed
        try:
            return await self.import_round(rx.transfer, rx.pieces(), final, source, None)
        finally:
            rx.close()  # also when the import stopped before the end (a refused round)
            rx.ended = time.monotonic()

    def forget(self, rx: _Receive) -> None:
        if self.receives.get(rx.transfer) is rx:
            del self.receives[rx.transfer]

    def current(self, transfer: str) -> _Receive:
        rx = self.receives.get(check_id(transfer, "transfer id"))
        if rx is None:
            raise HTTPError(404, f"no mooncake round of transfer {transfer} is open here")
        return rx

    async def open(self, host: str, transfer: str, final: bool, source: str | None, timeout_s: float) -> dict:
        check_id(transfer, "transfer id")
        if source is not None and (len(source) > 2048 or not URL_RE.fullmatch(source)):
            raise HTTPError(400, "source must be the source replica's http(s) URL")
        why = unavailable()
        if why:
            raise HTTPError(400, f"transport mooncake is not available on the target: {why}")
        for tid, x in list(self.receives.items()):
            if x.ended is not None and time.monotonic() - x.ended > KEEP_ENDED_S:
                del self.receives[tid]
        old = self.receives.pop(transfer, None)
        if old is not None:  # a retry after a cut the target did not notice: the old round ends as cut
            old.queue.put_nowait(RoundCut())
            await asyncio.wait({old.task})  # type: ignore[arg-type]
        if sum(x.ended is None for x in self.receives.values()) >= MAX_RECEIVES:
            raise HTTPError(429, "too many mooncake rounds in flight on the target")
        ring = _Ring.take(ring_bytes())
        try:
            engine, session = await asyncio.to_thread(ENGINE.get, host)
            await asyncio.to_thread(ring.register, engine)
        except OSError as e:
            await asyncio.to_thread(ring.release)
            ENGINE.discard(ENGINE.engine)
            raise HTTPError(503, f"mooncake on the target: {e}") from None
        rx = self.receives[transfer] = _Receive(transfer, ring, SLOTS, min(max(timeout_s, 1.0), 3600.0))
        rx.task = asyncio.ensure_future(self.run(rx, final, source))
        rx.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: answered via outcome()
        return {"session": session, "addr": ring.addr, "size": ring.size, "slots": SLOTS}

    async def segment(self, transfer: str, seq: int, slot: int, length: int) -> dict:
        rx = self.current(transfer)
        if rx.task.done():  # type: ignore[union-attr]
            self.forget(rx)
            await self.outcome(rx)  # raises the refusal (a round cannot end well before its end)
        if seq != rx.seq or not 0 <= slot < rx.slots or not 0 < length <= rx.ring.size // rx.slots:
            raise HTTPError(400, f"bad segment (seq {seq}, expected {rx.seq}; slot {slot}; length {length})")
        rx.seq += 1
        taken = asyncio.get_running_loop().create_future()
        rx.queue.put_nowait((slot, length, taken))
        await self.outcome(rx, taken)
        return {"taken": seq}

    async def end(self, transfer: str) -> dict | None:
        rx = self.current(transfer)
        rx.queue.put_nowait(None)
        try:
            return await self.outcome(rx)
        finally:
            self.forget(rx)

    async def cut(self, transfer: str) -> dict:
        rx = self.receives.pop(check_id(transfer, "transfer id"), None)
        if rx is not None:
            rx.queue.put_nowait(RoundCut())
            await asyncio.wait({rx.task})  # type: ignore[arg-type]
        return {"cut": transfer}


async def receiver(request: Request) -> MooncakeReceiver:
    # async: FastAPI runs a plain-def dependency on its thread pool, a thread hop per request
    return request.app.state.mooncake


mooncake_router = APIRouter()  # the target's routes of a Mooncake round, behind the replica's bearer check


@mooncake_router.post(f"{MOONCAKE_PATH}/open")
async def open_round(request: Request, transfer: str, final: bool = False, source: str | None = None,
                     timeout_s: float = 300.0, rx: MooncakeReceiver = Depends(receiver)):
    host = (request.scope.get("server") or ("127.0.0.1", 0))[0]
    return await rx.open(host, transfer, final, source, timeout_s)


@mooncake_router.post(f"{MOONCAKE_PATH}/segment")
async def segment(transfer: str, seq: int, slot: int, length: int, rx: MooncakeReceiver = Depends(receiver)):
    return await rx.segment(transfer, seq, slot, length)


@mooncake_router.post(f"{MOONCAKE_PATH}/end")
async def end(transfer: str, rx: MooncakeReceiver = Depends(receiver)):
    return await rx.end(transfer)


@mooncake_router.post(f"{MOONCAKE_PATH}/cut")
async def cut(transfer: str, rx: MooncakeReceiver = Depends(receiver)):
    return await rx.cut(transfer)


# ---- source -----------------------------------------------------------------------------------------
def _host_towards(host: str) -> str:
    """This machine's address on the route to `host` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _write(engine: object, session: str, local: int, remote: int, n: int) -> None:
    """One slot, as one batch of ENTRY_BYTES entries (≤ MAX_BATCH); every return code checked."""
    offs = list(range(0, n, ENTRY_BYTES))
    for i in range(0, len(offs), MAX_BATCH):
        part = offs[i:i + MAX_BATCH]
        rc = engine.batch_transfer_sync_write(  # type: ignore[attr-defined]
            session, [local + o for o in part], [remote + o for o in part], [min(ENTRY_BYTES, n - o) for o in part])
        _check(rc, "batch_transfer_sync_write")


class MooncakeTransport:
    """Pushes a round into the target's Mooncake receive ring (see the module docstring); https
    targets, which Mooncake's TCP would not encrypt, go over `fallback` (HTTP)."""

    def __init__(self, token: str | None, fallback) -> None:
        self.token, self.fallback = token, fallback

    async def push(self, target: str, transfer: str, frames: RoundFrames, *, final: bool,
                   source: str | None, timeout_s: float) -> dict:
        u = urlsplit(target)
        if u.scheme != "http":
            return await self.fallback.push(target, transfer, frames, final=final, source=source, timeout_s=timeout_s)
        base = f"{target.rstrip('/')}{MOONCAKE_PATH}"
        ring: _Ring | None = None
        engine = None
        opened = False
        try:
            why = unavailable()
            if why:
                raise PushFailed(f"transport mooncake is not available on the source: {why}", False)
            async with httpx.AsyncClient(verify=tls_context(), timeout=timeout_s) as c:
                params: dict = {"transfer": transfer, "final": "true" if final else "false", "timeout_s": timeout_s}
                if source:
                    params["source"] = source
                peer = await self._post(c, f"{base}/open", params)
                opened = True
                try:
                    engine, _ = await asyncio.to_thread(ENGINE.get, _host_towards(u.hostname or "127.0.0.1"))
                    ring = _Ring.take(int(peer["size"]))
                    await asyncio.to_thread(ring.register, engine)
                    await self._send(c, base, transfer, frames, engine, str(peer["session"]), int(peer["addr"]),
                                     ring, int(peer["slots"]))
                    ring.release()  # every byte written: the staging ring is unregistered before the import ends
                    ring = None
                except OSError as e:  # Mooncake itself failed: rebuild its engine before the next round
                    if engine is not None:
                        ENGINE.discard(engine)
                    raise PushFailed(f"target import over mooncake: {e}", True) from None
                reply = await self._post(c, f"{base}/end", {"transfer": transfer})
                opened = False
                return reply
        except httpx.TransportError as e:
            raise PushFailed(f"target import: {type(e).__name__}: {e or 'no detail'}", True) from None
        finally:
            if opened:  # tell the target the round is cut, so it unregisters its ring now
                try:
                    async with httpx.AsyncClient(verify=tls_context(), timeout=10) as c:
                        await c.post(f"{base}/cut", params={"transfer": transfer}, headers=bearer_headers(self.token))
                except httpx.HTTPError:
                    pass  # the target's own timeout ends it
            if ring is not None:
                await asyncio.to_thread(ring.release)
            await frames.aclose()  # stops the round's producer now

    async def _post(self, c: httpx.AsyncClient, url: str, params: dict) -> dict:
        resp = await c.post(url, params=params, headers=bearer_headers(self.token))
        if resp.status_code >= 400:
            raise PushFailed(f"target import: HTTP {resp.status_code}: {error_message(resp)}", False)
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise PushFailed("target import: the answer is not a JSON object", False)
        return body

    async def _send(self, c: httpx.AsyncClient, base: str, transfer: str, frames: RoundFrames,
                    engine: object, session: str, peer_addr: int, ring: _Ring, slots: int) -> None:
        """Fill a slot of the local ring, write it to the same slot of the target's, tell the target;
        a slot is refilled only once the target said it took that slot's bytes."""
        slot = ring.size // slots
        credits = asyncio.Semaphore(slots)
        written: asyncio.Queue = asyncio.Queue()
        filled: asyncio.Queue = asyncio.Queue()

        async def produce() -> None:
            seq, n = 0, 0
            await credits.acquire()
            async for f in frames:
                mv = memoryview(f).cast("B")
                while mv:
                    k = seq % slots
                    take = min(len(mv), slot - n)
                    ring.view[k * slot + n:k * slot + n + take] = mv[:take]
                    n, mv = n + take, mv[take:]
                    if n == slot:
                        filled.put_nowait((k, n, seq))
                        seq, n = seq + 1, 0
                        await credits.acquire()
            if n:
                filled.put_nowait((seq % slots, n, seq))
            filled.put_nowait(None)

        inflight: list[asyncio.Future] = []  # the write running in a thread, which a cancel does not stop

        async def write() -> None:
            loop = asyncio.get_running_loop()
            while (item := await filled.get()) is not None:
                k, n, _ = item
                inflight[:] = [loop.run_in_executor(None, _write, engine, session, ring.addr + k * slot,
                                                    peer_addr + k * slot, n)]
                await asyncio.shield(inflight[0])
                written.put_nowait(item)
            written.put_nowait(None)

        async def notify() -> None:
            while (item := await written.get()) is not None:
                k, n, seq = item
                await self._post(c, f"{base}/segment", {"transfer": transfer, "seq": seq, "slot": k, "length": n})
                credits.release()

        tasks = [asyncio.ensure_future(t()) for t in (produce, write, notify)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()  # the first failure, if any
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if inflight and not inflight[0].done():  # the staging ring is released after this: wait for its reader
                await asyncio.wait(inflight, timeout=60)
            if inflight and inflight[0].done() and not inflight[0].cancelled():
                inflight[0].exception()  # retrieved: the failure that counts was raised above
