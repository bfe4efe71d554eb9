"""How a round's frames travel from the source replica to the target replica (docs/protocol.md).

The migrator asks the source to export a round *to* the target (`target` in the export
request); the source pushes the frames itself, so the KV crosses one hop and the migrator only
sees small control messages. `Transport` is the seam: `HttpTransport` posts the frames to the
target's import route (chunked HTTP, the replica's bearer token); another transport (an RDMA
transfer engine, say) implements the same `push` and nothing else changes.

A round's frames are one `RoundFrames`: one producer (`RoundFrames.blocking`, a blocking iterator
that copies, hashes and frames the chunks, throttled in one place), which a transport's sending
thread drives itself (the frame link) or an event loop pulls a batch at a time (`async for`: HTTP,
Mooncake). Blocking work runs on `ROUND_WORKERS`, threads kept for the process's life: a round starts
none. Pre-copy rounds may be throttled to `RELAYOUT_PRECOPY_MBPS` megabytes per second so that, on
a CPU box, the source's decoding keeps its share of the cores; the final round (sessions paused)
never is."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

import httpx
from relayout.engine.tracing import async_inject_hooks
from relayout.engine.web import bearer_headers, error_message, tls_context
from relayout.storage.format.chunks import work_inline
from relayout.storage.settings import settings

if TYPE_CHECKING:
    from relayout.migrate.transport.frame_sink import FrameOptions

log = logging.getLogger(__name__)
IMPORT_PATH = "/v1/sessions/import"
T = TypeVar("T")
PULL_BYTES = 1 << 20  # what an event loop's pull of a round's frames takes at once (one hand-off per MiB)
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
    """How a round reaches the target replica: HttpTransport, migrate.transport.frame_link.TcpTransport,
    migrate.transport.mooncake.MooncakeTransport."""

    async def push(self, target: str, transfer: str, frames: RoundFrames, *, final: bool,
                   source: str | None, timeout_s: float) -> dict:
        """Deliver one round's frames to the target replica; its import reply (a dict), or PushFailed."""
        ...


class HttpTransport:
    """Chunked HTTP POST to the target's import route, authenticated with the replica's token."""

    def __init__(self, token: str | None):
        self.token = token

    async def push(self, target: str, transfer: str, frames: RoundFrames, *, final: bool,
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
            await frames.aclose()  # stops the round's producer now, not whenever the iterator is collected
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


class RoundWorkers:
    """Daemon threads kept for the process's life that carry rounds' blocking work (sending or
    reading a link, producing frames): a round starts no thread. An idle one takes the next job;
    another starts only when every one is busy. `init` runs once on each (a pre-copy worker's
    priority: Linux cannot raise a thread's again, so background work keeps threads of its own)."""

    def __init__(self, name: str, init: Callable[[], None] | None = None):
        self.name, self.init = name, init
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0
        self.started = 0  # threads in all (tests: rounds reuse them)
        self.submitted = 0  # jobs in all

    @property
    def busy(self) -> int:
        return self.started - self.idle

    def submit(self, job: Callable[[], None]) -> None:
        with self.lock:
            self.submitted += 1
            if self.idle:
                self.idle -= 1
            else:
                self.started += 1
                threading.Thread(target=self._run, name=f"{self.name}-{self.started}", daemon=True).start()
        self.jobs.put(job)

    def _run(self) -> None:
        if self.init is not None:
            self.init()
        while True:
            job = self.jobs.get()
            try:
                job()
            except BaseException:  # noqa: BLE001 - a job reports its own outcome; the thread serves on
                log.exception("%s: a job failed", self.name)
            job = None  # type: ignore[assignment]  # the round's buffers are not kept alive until the next job
            with self.lock:
                self.idle += 1


ROUND_WORKERS = RoundWorkers("round-io")
PRECOPY_WORKERS = RoundWorkers("precopy-io", init=background_thread)  # pre-copy rounds: niced, copies inline


async def on_worker(fn: Callable[..., T], *args: object, background: bool = False) -> T:
    """fn(*args) on a round worker (a pre-copy one when `background`), awaited."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(res: object, exc: BaseException | None) -> None:
        if not fut.done():  # (cancelled: nobody waits for it any more)
            fut.set_result(res) if exc is None else fut.set_exception(exc)

    def run() -> None:
        res, exc = None, None
        try:
            res = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            # (a future cannot hold a StopIteration: it would never be settled, its awaiter hung)
            exc = RuntimeError(f"{fn!r} raised StopIteration") if isinstance(e, StopIteration) else e
        try:
            loop.call_soon_threadsafe(settle, res, exc)
        except RuntimeError:
            pass  # the loop is gone

    (PRECOPY_WORKERS if background else ROUND_WORKERS).submit(run)
    return await fut


class RoundFrames:
    """One round's frames for a transport, from the (blocking) iterator that produces them, at most
    `mbps` MB/s; `counter[0]` counts the bytes handed on. Taken one way: `blocking()`, by a thread
    that sends each piece as it is produced (the frame link: no event loop and no extra copy between
    the producer and the kernel), or by `async for`, which pulls them from `blocking()` on a round
    worker about PULL_BYTES at a time (HTTP, Mooncake). `background` (a pre-copy round): its frames
    are produced on a pre-copy worker. `options`: the frames' migrate.transport.frame_sink.FrameOptions,
    which a transport may set before they start; `header`: the round's sessions and their KV tokens,
    which a transport may send ahead of the frames (the frame link's hello)."""

    def __init__(self, frames: Iterator[bytes], mbps: float | None = None, counter: list[int] | None = None,
                 background: bool = False, options: FrameOptions | None = None, inline: bool = False,
                 header: dict[str, int] | None = None):
        self.frames, self.mbps, self.background = frames, mbps, background
        self.inline = inline  # cheap to produce: see blocking()
        self.options = options
        self.header = header or {}  # the round's sessions -> their KV tokens (a target reserves for them first)
        self.counter = counter if counter is not None else [0]
        self._aiter: AsyncIterator[bytes] | None = None

    def blocking(self) -> Iterator[bytes]:
        """The frames for a thread that sends each as it comes. A final round's are produced on a
        round worker up to AHEAD_BYTES ahead (the sessions are paused: its copies and the sending
        share the cores, and the round is the stall); a pre-copy round's are produced by the
        sending thread itself, one pre-copy worker beside the decoding, not two; and so are
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
        close = getattr(self.frames, "close", None)  # (a generator's; a plain iterator has none)
        if close is not None:
            try:
                close()
            except ValueError:  # "generator already executing": its own thread closes it when it stops
                pass

    def __aiter__(self) -> AsyncIterator[bytes]:
        if self._aiter is None:
            self._aiter = self._pulled()
        return self._aiter

    async def _pulled(self) -> AsyncIterator[bytes]:
        it = self.blocking()
        pulling = threading.Lock()  # held while a worker takes from `it` (a running generator cannot be closed)

        def take() -> list[bytes]:
            with pulling:
                return _take(it, PULL_BYTES)  # ([] once `it` was closed)

        try:
            while batch := await on_worker(take, background=self.background):
                for piece in batch:
                    yield piece
        finally:
            # closing it runs its finally, which closes the source: now, or (cancelled while a worker
            # takes from it) once that take returns
            if pulling.acquire(blocking=False):
                try:
                    it.close()  # type: ignore[attr-defined]
                finally:
                    pulling.release()
            else:
                ROUND_WORKERS.submit(lambda: _close_after(pulling, it))

    async def aclose(self) -> None:
        if self._aiter is not None:
            await self._aiter.aclose()  # type: ignore[attr-defined]
        else:
            self.close_source()


def _close_after(pulling: threading.Lock, it: Iterator[bytes]) -> None:
    with pulling:
        it.close()  # type: ignore[attr-defined]


def _take(it: Iterator[bytes], max_bytes: int) -> list[bytes]:
    """The next pieces of `it`, about `max_bytes` of them ([] at its end)."""
    out, n = [], 0
    for piece in it:
        out.append(piece)
        n += _nbytes(piece)
        if n >= max_bytes:
            break
    return out


def _nbytes(piece: bytes | memoryview) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else len(piece)


def _produced_ahead(rf: RoundFrames, max_bytes: int) -> Iterator[bytes]:
    """rf's frames, produced on a round worker at most `max_bytes` ahead of the caller; a
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

    ROUND_WORKERS.submit(produce)
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
