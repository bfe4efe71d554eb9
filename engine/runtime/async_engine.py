"""AsyncEngine: the LLMEngine's step loop on one dedicated thread, with an asyncio front.

Only the loop thread ever touches the LLMEngine. asyncio code talks to it through
thread-safe hand-offs: `call(fn)` queues a function that runs *between two steps* (the
seam checkpoint/migration code uses to pause, export and import sessions atomically
w.r.t. decoding), `abort` queues an abort, and streams read per-session snapshots that
the loop thread publishes after every step and every call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from relayout.engine.ranks.workers import RankFailure
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams, SessionState, SessionStatus

T = TypeVar("T")

STEP_DECAY = 0.98  # recent_step_s forgets a long step over ~100 steps
_IDLE_RETRY_S = 0.05  # has_work() but nothing schedulable (e.g. every holder of blocks paused)
_MAX_DONE_SNAPSHOTS = 4096


class EngineDeadError(RuntimeError):
    """The engine failed (or was stopped); no further steps will run."""


@dataclass
class _Snap:
    """What the asyncio side may read about one session (guarded by AsyncEngine._lock)."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    status: SessionStatus = SessionStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[list] = field(default_factory=list)  # per token, when the session asked for them
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.status in (SessionStatus.FINISHED, SessionStatus.MIGRATED, SessionStatus.CHECKPOINTED)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.migrated_to: dict[str, str] = {}  # session id -> replica URL it moved to
        self.checkpointed_to: dict[str, str] = {}  # session id -> checkpoint URI it was stopped into
        # client streams reading each session, and the aborts pending for detached ones (asyncio side only)
        self._readers: dict[str, int] = {}
        self._detached: dict[str, asyncio.TimerHandle] = {}
        self.engine = engine
        self._lock = threading.Lock()  # guards _snaps, _calls, _aborts, _stopping
        self._wake = threading.Condition(self._lock)
        self._snaps: OrderedDict[str, _Snap] = OrderedDict()
        self._calls: list[tuple[Callable[[LLMEngine], object], cf.Future]] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # plain counters mirrored from the engine thread, readable without a call()
        self.num_steps = 0
        self.tokens_generated = 0
        self.kv_blocks_used = 0
        # the longest step lately (seconds; decays by STEP_DECAY a step): how long a call queued now
        # may wait for the step boundary (a protection fences this much ahead of its lease's end)
        self.recent_step_s = 0.0

    # ---- lifecycle ---------------------------------------------------------------
    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="relayout-engine", daemon=True)
            self._thread.start()
        return self

    async def stop(self) -> None:
        """Stop the loop thread (which shuts the engine down) and end every open stream."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def stop_sync(self, timeout: float | None = None) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def started(self) -> bool:
        """Whether the loop thread was started (it shuts the engine down when it ends)."""
        return self._thread is not None

    @property
    def num_running(self) -> int:
        """Sessions not yet finished or migrated (waiting, running or paused)."""
        with self._lock:
            return sum(1 for sn in self._snaps.values() if not sn.done)

    def note_migrated(self, session_ids: list[str], url: str) -> None:
        """Remember where sessions went, so a client that asks here is sent on."""
        for sid in session_ids:
            self.migrated_to[sid] = url

    def note_checkpointed(self, session_ids: list[str], uri: str) -> None:
        """Remember the checkpoint that sessions released by a checkpoint with stop went to."""
        for sid in session_ids:
            self.checkpointed_to[sid] = uri

    # ---- client streams: attach, detach (asyncio side) -------------------------------
    def attach(self, session_id: str) -> None:
        """A client stream reads the session: an abort pending after a bare disconnect is called off."""
        self._readers[session_id] = self._readers.get(session_id, 0) + 1
        pending = self._detached.pop(session_id, None)
        if pending is not None:
            pending.cancel()

    def detach(self, session_id: str, grace_s: float | None) -> None:
        """A client stream stopped reading. `grace_s` None: it ended normally. Else it was cut
        (a bare disconnect): once no stream reads the session for `grace_s` seconds it is aborted
        (it keeps generating meanwhile, so a reattach finds it where it would have been)."""
        left = self._readers.get(session_id, 1) - 1
        if left > 0:
            self._readers[session_id] = left
            return
        self._readers.pop(session_id, None)
        if grace_s is None:
            return
        if grace_s <= 0:
            self.abort(session_id)
            return
        pending = self._detached.pop(session_id, None)
        if pending is not None:
            pending.cancel()
        self._detached[session_id] = asyncio.get_running_loop().call_later(grace_s, self._grace_over, session_id)

    def _grace_over(self, session_id: str) -> None:
        self._detached.pop(session_id, None)
        if not self._readers.get(session_id):
            self.abort(session_id)  # a finished or moved session: a no-op

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive() and not self._stopping

    # ---- requests ----------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread at a step boundary; its result or exception comes
        back. A rank that died under it has taken the replica down (as a failed step would):
        the caller gets EngineDeadError, like every later caller."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self.error is not None or self._stopping or self._thread is None:
                raise self.dead_error()
            self._calls.append((fn, fut))
            self._wake.notify()
        try:
            return await asyncio.wrap_future(fut)
        except RankFailure:
            err = self.dead_error()
            raise err from err.__cause__

    async def submit(self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None) -> SessionState:
        # add_session and the snapshot happen in one call, so stream()/get() see the session at once
        return await self.call(lambda e: e.add_session(prompt_ids, params, session_id))

    def abort(self, session_id: str) -> None:
        """Thread-safe; applied at the next step boundary (frees the session's KV blocks)."""
        with self._lock:
            self._aborts.append(session_id)
            self._wake.notify()

    def get(self, session_id: str, token_ids: bool = True) -> dict | None:
        """The session as its route shows it; `token_ids` False leaves the id lists out (their counts
        stay): a watcher polling the state does not copy and encode thousands of ids a call."""
        with self._lock:
            s = self._snaps.get(session_id)
            if s is None:
                return None
            out = {"id": session_id, "state": s.status.value, "finish_reason": s.finish_reason,
                   "num_prompt_tokens": len(s.prompt_token_ids), "num_generated_tokens": len(s.token_ids)}
            if token_ids:
                out.update(prompt_token_ids=list(s.prompt_token_ids), token_ids=list(s.token_ids))
            return out

    def logprobs(self, session_id: str, lo: int, hi: int) -> list[list]:
        """Logprob records of generated tokens [lo, hi) (published with the ids: a batch from
        `stream` has them); empty for a session that did not ask for logprobs."""
        with self._lock:
            s = self._snaps.get(session_id)
            return list(s.logprobs[lo:hi]) if s is not None else []

    async def stream(self, session_id: str, from_token: int = 0) -> AsyncIterator[list[int]]:
        """Batches of generated token ids from index `from_token` on, until the session is
        finished or migrated (then `get()` shows which). Raises KeyError for an unknown
        session, EngineDeadError if the engine fails or stops first."""
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        with self._lock:
            snap = self._snaps.get(session_id)
            if snap is None:
                raise KeyError(session_id)
            snap.waiters.append((loop, ev))
        pos = max(0, from_token)
        try:
            while True:
                ev.clear()  # before reading: a publish after this read sets it again
                with self._lock:
                    new = snap.token_ids[pos:]
                    done = snap.done
                    dead = self.error is not None or (self._stopping and not done)
                if new:
                    pos += len(new)
                    yield new
                if done:
                    return
                if dead:
                    raise self.dead_error()
                await ev.wait()
        finally:
            with self._lock:
                if (loop, ev) in snap.waiters:
                    snap.waiters.remove((loop, ev))

    def dead_error(self) -> EngineDeadError:
        """Why this engine serves no more (the error to raise or report once not `healthy`)."""
        if self.error is not None:
            err = EngineDeadError(f"engine failed: {type(self.error).__name__}: {self.error}")
            err.__cause__ = self.error
            return err
        return EngineDeadError("engine is stopped")

    # ---- the engine thread -----------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._lock:
                    while not (self._calls or self._aborts or self._stopping or (self.error is None and eng.has_work())):
                        self._wake.wait()
                    calls, self._calls = self._calls, []
                    aborts, self._aborts = self._aborts, []
                    stopping = self._stopping
                outcomes = []
                rank_failure: BaseException | None = None
                for fn, fut in calls:
                    if fut.set_running_or_notify_cancel():
                        try:
                            outcomes.append((fut, fn(eng), None))
                        except BaseException as e:  # noqa: BLE001 - handed to the caller
                            outcomes.append((fut, None, e))
                            if isinstance(e, RankFailure):
                                rank_failure = e  # the replica is down, whoever noticed it
                for sid in aborts:
                    try:
                        eng.abort(sid)
                    except Exception:  # noqa: BLE001 - an abort must never take the loop down
                        pass
                if calls or aborts:
                    self._publish_all()  # a call may pause, finish, migrate, import or drop sessions
                if rank_failure is not None:  # before the results: their callers find the replica down
                    self._fail(rank_failure)
                # results only after publishing: a caller sees the snapshots its call produced
                for fut, res, exc in outcomes:
                    if exc is None:
                        fut.set_result(res)
                    else:
                        fut.set_exception(exc)
                if stopping:
                    return
                if self.error is not None or not eng.has_work():
                    continue
                before, t0 = eng.num_steps, time.perf_counter()
                try:
                    events = eng.step()
                except BaseException as e:  # noqa: BLE001 - e.g. a rank of the replica died
                    self._fail(e)
                    continue
                self.recent_step_s = max(time.perf_counter() - t0, self.recent_step_s * STEP_DECAY)
                self._publish({ev.session_id for ev in events})
                if eng.num_steps == before and not events:
                    with self._lock:  # nothing could be scheduled: wait for a change, don't spin
                        if not (self._calls or self._aborts or self._stopping):
                            self._wake.wait(_IDLE_RETRY_S)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            calls, self._calls = self._calls, []
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(self.dead_error())
        try:
            self.engine.shutdown()
        finally:
            self._notify_all()  # streams see _stopping and end

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            self.error = e
            calls, self._calls = self._calls, []
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(self.dead_error())
        self._notify_all()

    def _publish(self, sids: set[str]) -> None:
        """Copy the engine's view of `sids` into the snapshots and wake their streams."""
        eng = self.engine
        wake: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        with self._lock:
            for sid in sids:
                s = eng.sessions.get(sid)
                snap = self._snaps.get(sid)
                if s is None:
                    if snap is not None and not snap.done:
                        # a live session that left the engine was moved away by a call()
                        snap.status = SessionStatus.MIGRATED
                        wake += snap.waiters
                    continue
                if snap is None:
                    snap = self._snaps[sid] = _Snap(list(s.prompt_token_ids))
                if len(s.output_token_ids) > len(snap.token_ids):
                    snap.token_ids.extend(s.output_token_ids[len(snap.token_ids):])
                elif len(s.output_token_ids) < len(snap.token_ids):  # replaced by an import
                    snap.token_ids = list(s.output_token_ids)
                    snap.logprobs = []
                if len(s.logprobs) > len(snap.logprobs):
                    snap.logprobs.extend(s.logprobs[len(snap.logprobs):])
                snap.status, snap.finish_reason = s.status, s.finish_reason
                wake += snap.waiters
            if len(self._snaps) > _MAX_DONE_SNAPSHOTS + 256:  # amortised: trim in batches
                self._trim()
            self.num_steps = eng.num_steps
            self.tokens_generated = eng.tokens_generated
            self.kv_blocks_used = eng.kv_blocks_used()
        for loop, ev in wake:
            _set_threadsafe(loop, ev)

    def _publish_all(self) -> None:
        with self._lock:
            live = {sid for sid, sn in self._snaps.items() if not sn.done}
        self._publish(live | {sid for sid, s in self.engine.sessions.items() if not s.is_finished})

    def _trim(self) -> None:
        done = [sid for sid, sn in self._snaps.items() if sn.done and not sn.waiters]
        for sid in done[: max(0, len(done) - _MAX_DONE_SNAPSHOTS)]:
            del self._snaps[sid]

    def _notify_all(self) -> None:
        with self._lock:
            wake = [w for sn in self._snaps.values() for w in sn.waiters]
        for loop, ev in wake:
            _set_threadsafe(loop, ev)


def _set_threadsafe(loop: asyncio.AbstractEventLoop, ev: asyncio.Event) -> None:
    try:
        loop.call_soon_threadsafe(ev.set)
    except RuntimeError:  # that event loop is closed: nobody is waiting any more
        pass
