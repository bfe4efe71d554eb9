"""How a round's frames travel from the source replica to the target replica (docs/protocol.md).

The migrator asks the source to export a round *to* the target (`target` in the export
request); the source pushes the frames itself, so the KV crosses one hop and the migrator only
sees small control messages. `Transport` is the seam: `HttpTransport` posts the frames to the
target's import route (chunked HTTP, the replica's bearer token); another transport (an RDMA
transfer engine, say) implements the same `push` and nothing else changes.

The frames are produced by a thread (cutting chunks into frames, hashing) a few frames ahead of
the sender (`pump`), so producing and sending overlap and the event loop never hashes. Pre-copy
rounds may be throttled to `RELAYOUT_PRECOPY_MBPS` megabytes per second so that, on a CPU box,
the source's decoding keeps its share of the cores; the final round (sessions paused) never is."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Protocol, TypeVar

import httpx
from relayout.engine.tracing import async_inject_hooks
from relayout.engine.web import bearer_headers, error_message, tls_context
from relayout.storage.format.chunks import work_inline
from relayout.storage.settings import settings

IMPORT_PATH = "/v1/sessions/import"
T = TypeVar("T")
PUMP_DEPTH = 6  # frames produced ahead of the sender (each at most a chunk: a few MiB)
# a final round's bytes produced ahead of the frame link's socket (about two batches of chunks at
# 4k tokens): the copy out of the pool and the hash of one batch overlap the sending of the one before
AHEAD_BYTES = 32 << 20


class RoundCut(Exception):
    """The sender of an import round went away mid-stream (raised by the round's byte source)."""


class PushFailed(Exception):
    """The round did not reach the target. `retryable`: the link failed (cut, refused, timed out),
    so the round may be resumed from the chunks the target acknowledges; otherwise the target
    refused it (garbled frames, no room, a dead rank)."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


class Transport(Protocol):
    async def push(self, target: str, transfer: str, frames: AsyncIterator[bytes], *, final: bool,
                   source: str | None, timeout_s: float) -> dict:
        """Deliver one round's frames to the target replica; its import reply (a dict), or PushFailed."""
        ...


class HttpTransport:
    """Chunked HTTP POST to the target's import route, authenticated with the replica's token."""

    def __init__(self, token: str | None):
        self.token = token

    async def push(self, target: str, transfer: str, frames: AsyncIterator[bytes], *, final: bool,
                   source: str | None, timeout_s: float) -> dict:
        params: dict = {"transfer": transfer, "final": "true" if final else "false"}
        if source:
            params["source"] = source  # whom the target asks if the migrator disappears
        try:
            # traceparent: the target's import continues the migrator's trace, under this export
            async with httpx.AsyncClient(verify=tls_context(), timeout=timeout_s, event_hooks=async_inject_hooks()) as client:
                resp = await client.post(f"{target.rstrip('/')}{IMPORT_PATH}", params=params, content=frames,
                                         headers=bearer_headers(self.token))
                await resp.aread()
        except httpx.TransportError as e:
            raise PushFailed(f"target import: {type(e).__name__}: {e or 'no detail'}", retryable=True) from None
        finally:
            close = getattr(frames, "aclose", None)
            if close is not None:  # stops the round's producer now, not whenever the iterator is collected
                await close()
        if resp.status_code >= 400:
            raise PushFailed(f"target import: HTTP {resp.status_code}: {error_message(resp)}", retryable=False)
        try:
            reply = resp.json()
        except ValueError:
            raise PushFailed("target import: the answer is not JSON", retryable=False) from None
        if not isinstance(reply, dict):
            raise PushFailed("target import: the answer is not a JSON object", retryable=False)
        return reply


def precopy_mbps() -> float | None:
    """RELAYOUT_PRECOPY_MBPS: the pre-copy budget in MB/s (unset or 0: unthrottled)."""
    v = settings().precopy_mbps
    return v if v > 0 else None


def precopy_nice() -> int | str:
    """RELAYOUT_PRECOPY_NICE: the nice value of the threads that copy, hash and move pre-copy rounds
    (default 10: under contention the kernel gives them about a tenth of what a decoding thread
    gets; 0: the same as decoding), or `idle` (Linux SCHED_IDLE: they run only on cycles nothing
    else wants, so pre-copy may take much longer on a busy box)."""
    return settings().precopy_nice


def background_thread(nice: int | str | None = None) -> None:
    """Make the calling thread a pre-copy worker: lower its priority (Linux: nice and the policy are
    per thread; neither can be raised again, so only threads made for one round call this) and keep
    its copies on it rather than on the shared chunk pool, whose threads run at normal priority.
    `nice`: instead of precopy_nice()'s (the bench's loaded-link probe)."""
    nice = precopy_nice() if nice is None else nice
    try:
        if nice == "idle" and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        elif isinstance(nice, int) and nice and hasattr(os, "setpriority"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        pass  # not permitted here: the round runs at normal priority
    work_inline()


async def in_thread(fn: Callable[..., T], *args: object, background: bool = False) -> T:
    """fn(*args) on a thread of its own (a pre-copy worker when `background`), awaited."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(res: object, exc: BaseException | None) -> None:
        if not fut.done():  # (cancelled: nobody waits for it any more)
            fut.set_result(res) if exc is None else fut.set_exception(exc)

    def run() -> None:
        res, exc = None, None
        try:
            if background:
                background_thread()
            res = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            # (a future cannot hold a StopIteration: it would never be settled, its awaiter hung)
            exc = RuntimeError(f"{fn!r} raised StopIteration") if isinstance(e, StopIteration) else e
        try:
            loop.call_soon_threadsafe(settle, res, exc)
        except RuntimeError:
            pass  # the loop is gone

    threading.Thread(target=run, name="round-worker", daemon=True).start()
    return await fut


class RoundFrames:
    """One round's frames for a transport, from the (blocking) iterator that produces them, at most
    `mbps` MB/s; `counter[0]` counts the bytes handed on. Two ways to take them: `async for` (a
    producer thread runs PUMP_DEPTH frames ahead of the event loop: HTTP), or `blocking()` from a
    thread of the transport's own that writes each piece to its socket as it is produced (the frame
    link: no event loop and no extra copy between the producer and the kernel). `background` (a
    pre-copy round): whichever thread produces them is a pre-copy worker (`background_thread`)."""

    def __init__(self, frames: Iterator[bytes], mbps: float | None = None, depth: int = PUMP_DEPTH,
                 counter: list[int] | None = None, background: bool = False, options: object = None,
                 inline: bool = False):
        self.frames, self.mbps, self.depth, self.background = frames, mbps, depth, background
        self.inline = inline  # cheap to produce: see blocking()
        self.options = options  # the frames' migrate.transport.frame_sink.FrameOptions, which a transport may set before they start
        self.counter = counter if counter is not None else [0]
        self._aiter: AsyncIterator[bytes] | None = None

    def blocking(self) -> Iterator[bytes]:
        """The frames for a thread that sends each as it comes. A final round's are produced on a
        thread of their own up to AHEAD_BYTES ahead (the sessions are paused: its copies and the
        sending share the cores, and the round is the stall); a pre-copy round's are produced by
        the sending thread itself, one pre-copy worker beside the decoding, not two; and so are
        `inline` ones (a final round's chunks in place: producing one is hashing it, just before it
        is sent, whose copy into the socket then reads it from this core's cache)."""
        t0, sent = time.perf_counter(), 0
        try:
            for f in (self.frames if self.background or self.inline else _produced_ahead(self, AHEAD_BYTES)):
                yield f
                sent += len(f)
                self.counter[0] = sent
                if self.mbps:
                    ahead = sent / (self.mbps * 1e6) - (time.perf_counter() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        finally:
            self.close_source()

    def close_source(self) -> None:
        close = getattr(self.frames, "close", None)
        if close is not None:
            try:
                close()
            except ValueError:  # "generator already executing": its own thread closes it when it stops
                pass

    def __aiter__(self) -> AsyncIterator[bytes]:
        if self._aiter is None:
            self._aiter = _pumped(self)
        return self._aiter

    async def __anext__(self) -> bytes:
        return await self.__aiter__().__anext__()

    async def aclose(self) -> None:
        if self._aiter is not None:
            await self._aiter.aclose()  # type: ignore[attr-defined]
        else:
            self.close_source()


def _nbytes(piece: bytes | memoryview) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else len(piece)


def _produced_ahead(rf: RoundFrames, max_bytes: int) -> Iterator[bytes]:
    """rf's frames, produced by a thread of their own at most `max_bytes` ahead of the caller; a
    producer's exception is raised after the frames it produced before it. The producer stops (and
    closes the frames) once the caller stops taking them."""
    queued: deque = deque()
    cond = threading.Condition()
    state: dict = {"bytes": 0, "done": False, "error": None}
    stop = threading.Event()

    def produce() -> None:
        try:
            for f in rf.frames:
                n = _nbytes(f)
                with cond:
                    while state["bytes"] >= max_bytes and not stop.is_set():
                        cond.wait(0.25)
                    if stop.is_set():
                        return
                    queued.append(f)
                    state["bytes"] += n
                    cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised by the caller, in order
            state["error"] = e
        finally:
            rf.close_source()
            with cond:
                state["done"] = True
                cond.notify_all()

    threading.Thread(target=produce, name="frame-producer", daemon=True).start()
    try:
        while True:
            with cond:
                while not queued and not state["done"]:
                    cond.wait()
                if not queued:
                    if state["error"] is not None:
                        raise state["error"]
                    return
                f = queued.popleft()
                state["bytes"] -= _nbytes(f)
                cond.notify_all()
            yield f
    finally:
        stop.set()
        with cond:
            cond.notify_all()


def pump(frames: Iterator[bytes], mbps: float | None = None, depth: int = PUMP_DEPTH,
         counter: list[int] | None = None, background: bool = False, options: object = None,
         inline: bool = False) -> RoundFrames:
    return RoundFrames(frames, mbps, depth, counter, background, options, inline)


async def _pumped(rf: RoundFrames) -> AsyncIterator[bytes]:
    """The frames, produced by a thread `depth` frames ahead of the event loop."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    room = threading.Semaphore(rf.depth)
    stop = threading.Event()
    end = object()
    frames = rf.frames

    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop is gone: nobody is listening any more
            stop.set()

    def produce() -> None:
        if rf.background:
            background_thread()
        try:
            for f in frames:
                while not room.acquire(timeout=0.25):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                put(f)
            put(end)
        except BaseException as e:  # noqa: BLE001 - handed to the sender, which raises it
            put(e)
        finally:
            rf.close_source()

    threading.Thread(target=produce, name="frame-pump", daemon=True).start()
    t0, sent = time.perf_counter(), 0
    try:
        while True:
            item = await q.get()
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            room.release()
            yield item  # type: ignore[misc]
            sent += len(item)  # type: ignore[arg-type]
            rf.counter[0] = sent
            if rf.mbps:
                ahead = sent / (rf.mbps * 1e6) - (time.perf_counter() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)
    finally:
        stop.set()
        room.release()


async def progress_stream(push: Awaitable[dict], counter: list[int], every_s: float = 1.0,
                          not_moved: dict[str, str] | None = None) -> AsyncIterator[bytes]:
    """The export reply of a pushed round: a space every `every_s` while the push runs (so the
    migrator's read timeout measures silence, not the round's length), then one JSON object,
    {"reply": <target's import reply>, "bytes": n, "not_moved": {session: why}} or
    {"error": {"message"}, "retryable"}. `not_moved`: the sessions asked for that the round does not carry."""
    task = asyncio.ensure_future(push)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                break
            yield b" "
        try:
            out: dict = {"reply": task.result(), "bytes": counter[0], "not_moved": not_moved or {}}
        except PushFailed as e:
            out = {"error": {"message": str(e), "type": "push_failed"}, "retryable": e.retryable, "bytes": counter[0]}
        except asyncio.CancelledError:
            out = {"error": {"message": "the transfer was aborted on the source while its round was being sent",
                             "type": "conflict"}, "retryable": False, "bytes": counter[0]}
        except Exception as e:  # noqa: BLE001 - reported to the migrator, which aborts
            out = {"error": {"message": f"source push failed: {type(e).__name__}: {e}", "type": "internal"},
                   "retryable": False, "bytes": counter[0]}
        yield json.dumps(out).encode()
    finally:
        if not task.done():  # the migrator went away: nobody will learn this round's outcome
            task.cancel()
