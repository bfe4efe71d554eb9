"""The replica's half of the live-migration protocol (docs/protocol.md): every transfer this replica takes
part in, as source (outgoing) or target (incoming), its lease, the two-phase commit and the sweeper that
decides alone once the migrator is gone. No HTTP here: `TransferTable` is driven by migrate.replica.routes
(or a test), reaches the engine through `EngineOps` and the source through `AskSource`.

Its states, their moves and its refusals are migrate.protocol.states's. Leases: a transfer idle for `ttl` seconds
is ended by the sweeper. The source resumes what it paused (a late release is refused from then on); the
target frees reservations of a transfer still receiving, and for one whose final round placed sessions
(in doubt) waits one more ttl, then asks the source how it ended: released (or unknown: the source
restarted) -> commit, aborted/expired -> drop; no answer for 10 ttl -> drop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from relayout.engine.moves.snapshot import write_snapshot_steps
from relayout.migrate.procs import TreeCpu
from relayout.migrate.protocol.received import ReadInto, read_round_bytes, receive_round_bytes
from relayout.migrate.protocol.states import (  # noqa: F401 - the refusals are re-exported: the routes map each to a status
    FINISHED_ON_SOURCE,
    AskSource,
    ImportTooLarge,
    IncomingState,
    OutgoingState,
    TooManyTransfers,
    TransferConflict,
    TransferError,
    UnknownSession,
    UnknownTransfer,
    check_transition,
)
from relayout.migrate.protocol.transfer_records import (  # noqa: F401 - re-exported: the protocol's records are the table's
    EngineOps,
    Incoming,
    Outgoing,
    SentRound,
    SourceRound,
)
from relayout.migrate.transport.base import RoundCut, on_worker
from relayout.migrate.transport.frame_sink import FrameOptions, FrameSink
from relayout.storage.checkpoint import CheckpointWriter
from relayout.storage.format.manifest import Manifest
from relayout.storage.settings import settings
from relayout.storage.stream import LimitExceeded, StreamReceiver, encode_abort_frame

MAX_TRANSFERS = 64  # incoming transfers in flight at once
DONE_KEEP = 1024  # finished transfers remembered (for a target that asks how one ended)
DOUBT_GIVE_UP = 10  # ttls a target in doubt keeps asking a silent source before it drops its copy
Clock = Callable[[], float]


def transfer_ttl() -> float:
    """Seconds a live transfer may sit idle before the replica decides it alone (its migrator is gone)."""
    return settings().transfer_ttl_s


# ---- the table ----------------------------------------------------------------------------------
class TransferTable:
    """Every transfer of one replica, both directions. Methods run on one asyncio loop, but for
    `import_link_round`, which runs on the frame link's thread: what the two share (opening an import,
    a round still writing into a dropped transfer's blocks) is changed under `_lock`."""

    def __init__(self, ops: EngineOps, ask_source: AskSource | None = None, *, clock: Clock = time.monotonic,
                 ttl: Callable[[], float] = transfer_ttl, import_limit: int = 1 << 62,
                 frame_limit: int | None = None, max_transfers: int = MAX_TRANSFERS, autosweep: bool = True):
        self.ops, self.ask_source, self.clock, self.ttl = ops, ask_source, clock, ttl
        self.import_limit, self.frame_limit = import_limit, frame_limit or import_limit
        self.max_transfers, self.autosweep = max_transfers, autosweep
        self.outgoing: dict[str, Outgoing] = {}
        self.incoming: dict[str, Incoming] = {}
        self.out_done: OrderedDict[str, OutgoingState] = OrderedDict()  # transfer -> how it ended (ENDED_OUTGOING)
        self.in_done: OrderedDict[str, IncomingState] = OrderedDict()  # transfer -> how it ended (ENDED_INCOMING)
        self._sweeper: asyncio.Task | None = None
        self._lock = threading.Lock()  # incoming's entries and their `receiving`, shared with the link's thread
        self.cpu = TreeCpu()  # this replica's CPU seconds, its ranks' included: each round's cost is reported

    # ---- what the replica reports -------------------------------------------------------------------
    def not_moved(self, tid: str) -> dict[str, str]:  # source: sessions the last round lacks, with why
        return dict(o.not_moved) if (o := self.outgoing.get(tid)) else {}

    def in_place(self, tid: str) -> bool:  # source: the last round's chunks are the pool's own rows
        return bool((o := self.outgoing.get(tid)) and o.in_place)

    def migrating_out(self) -> str | None:  # the outgoing transfer in flight, if any (at most one)
        return next(iter(self.outgoing), None)

    def round_header(self, tid: str) -> dict[str, int]:  # source: the last round's sessions and their KV tokens
        return dict(o.header) if (o := self.outgoing.get(tid)) else {}

    def state(self, tid: str) -> dict:
        """How this replica sees a transfer: outgoing active|paused|released|aborted|expired,
        incoming receiving|placed|committed|aborted|expired (None: unknown here)."""
        o, i = self.outgoing.get(tid), self.incoming.get(tid)
        return {"transfer": tid,
                "outgoing": o.state if o else self.out_done.get(tid),
                "incoming": i.state if i else self.in_done.get(tid),
                "placed": list(i.placed) if i else [],
                # chunks held (verified), so an interrupted round resumes after them
                "chunks": sorted(i.store.chunk_hashes()) if i else []}  # type: ignore[attr-defined]

    # ---- source ---------------------------------------------------------------------------------------
    async def export(self, tid: str, sessions: list[str] | None, pause: bool = False, codec: str = "none",
                     max_tokens: int | None = None, have: list[str] | None = None,
                     confirm_on_delivery: bool = False, options: FrameOptions | None = None) -> Iterator[bytes]:
        """SourceRound one round (the final one with `pause`) and return its frames, to be streamed to the
        target. `have`: a retry of a cut round — the chunks the target acknowledges holding.
        `confirm_on_delivery` (push): the round counts as sent once `push` delivered it, not once framed."""
        o = self.outgoing.get(tid)
        if o is None:
            if tid in self.out_done:
                raise TransferConflict(f"transfer {tid} already ended ({self.out_done[tid]})")
            if self.outgoing:
                raise TransferConflict(f"this replica is already migrating out (transfer {self.migrating_out()}): "
                                       "one outgoing migration at a time")
            o = self.outgoing[tid] = Outgoing(tid, self.clock())
            self._ensure_sweeper()
        if o.final:
            raise TransferConflict(f"transfer {tid} already ran its final round")
        o.last = self.clock()
        o.epoch += 1  # any round still being framed is superseded by this one
        epoch = o.epoch
        sent = dict(o.sent_upto)
        if have is not None:
            # the previous round was cut: what it sent may not have arrived; resend all but the
            # chunks the target says it holds (completed rounds' KV is before kv_from: not listed)
            o.target_holds = {h for h in have if isinstance(h, str) and len(h) == 32}
        try:
            t0 = time.perf_counter()
            cut = await self.ops.take_round(sessions, pause, sent, None if pause else max_tokens)
            # the wait for a step boundary is the decode's, not the path's: the round's figures start after it
            o.timing = {"cut_ms": round((time.perf_counter() - t0) * 1000, 2), "cpu_at_cut": self.cpu()}
        except KeyError as e:
            raise UnknownSession(str(e.args[0])) from None
        if self.outgoing.get(tid) is not o:  # expired or aborted meanwhile: give them back
            await self._resume(cut.paused)
            raise TransferConflict(f"transfer {tid} ended while its round was cut")
        o.paused, o.final, o.rounds, o.in_place = cut.paused, o.final or pause, o.rounds + 1, cut.in_place
        carried = {snap.session_id for snap in cut.snaps}
        o.header = cut.kv_tokens  # what a target reserves for, ahead
        o.not_moved = {**{sid: FINISHED_ON_SOURCE for sid in sessions or []
                          if sid not in carried}, **cut.not_moved}
        return self._frames(o, cut, sent, codec, pause, epoch, confirm_on_delivery, options)

    def _frames(self, o: Outgoing, cut: SourceRound, sent: dict[str, int], codec: str, final: bool, epoch: int,
                confirm_on_delivery: bool, options: FrameOptions | None = None) -> Iterator[bytes]:
        rnd = o.rounds
        try:
            # its own copy: a cut round's producer may still run when its retry starts (merged by mark_sent)
            sink = FrameSink(set(o.target_holds), options)
            sink.kv_tokens = cut.kv_tokens
            # a delta: each session's KV from where the rounds the target holds end (kv_from), so the
            # final round's manifest, on the stall's path, grows with what changed, not with the
            # context (16k tokens listed whole: ~15 ms more to build, check and parse here). A
            # session that finished since has no entry; the target frees its reservation
            w = CheckpointWriter(sink, f"{o.transfer_id}-r{rnd}", codec=codec, kv_from=sent)
            for _ in write_snapshot_steps(cut.snaps, w, sent):  # a batch of chunks at a time
                o.last = self.clock()
                yield from sink.take()
            w.commit(cut.model, cut.layout, cut.geometry, {"transfer": o.transfer_id, "round": rnd,
                                                           "final": final})
        except Exception as e:  # noqa: BLE001 - tell the receiver why, in-band, instead of a torn stream
            yield encode_abort_frame(f"source failed to export round {rnd}: {type(e).__name__}: {e}")
            return
        done = SentRound(epoch, cut.kv_tokens)
        o.framed = done
        if not confirm_on_delivery:
            o.mark_sent(done)
        o.last = self.clock()
        yield from sink.take()

    async def push(self, tid: str, send: Awaitable[dict]) -> dict:
        """Source: deliver an exported round (`send`); the lease holds while it runs (bounded by its timeout)."""
        task, o = asyncio.ensure_future(send), self.outgoing.get(tid)
        if o is None:
            task.cancel()
            raise TransferConflict(f"transfer {tid} ended before its round was sent")
        o.pushing = task  # ending the transfer cancels it
        try:
            while not (await asyncio.wait({task}, timeout=min(1.0, self.ttl() / 4)))[0]:
                o.last = self.clock()  # a round on a slow link is not an idle transfer
            reply, _ = task.result(), o.mark_sent(o.framed)  # delivered: the target holds these chunks now
            o.timing["cpu_s"] = round(self.cpu() - o.timing.pop("cpu_at_cut", self.cpu()), 4)
            return {**reply, "source_timing": o.timing} if isinstance(reply, dict) else reply
        finally:
            task.cancel()  # a no-op once done; else whoever awaited this round is gone
            if o.pushing is task:
                o.pushing = None

    async def release(self, session_ids: list[str], tid: str | None = None, migrated_to: str | None = None) -> None:
        """The commit, on the source: the target holds the sessions; free them here. With `tid`,
        refused unless that transfer is still live here (not expired)."""
        if tid is not None:
            if tid not in self.outgoing:
                raise TransferConflict(f"transfer {tid} is {self.out_done.get(tid, 'unknown')} on the source: "
                                       "not released, the sessions stay here")
            if not self.outgoing[tid].final:  # a migrator's mistake: the sessions were never held
                raise TransferConflict(f"transfer {tid} has not run its final round: not released")
            o = self.outgoing.pop(tid)  # no await since the check: the sweeper cannot expire it in between
            self._remember(self.out_done, tid, check_transition(o.state, OutgoingState.RELEASED))
        await self.ops.release(session_ids, migrated_to)

    async def end_outgoing(self, tid: str, state: OutgoingState) -> None:
        """Source: forget the transfer; sessions it paused and nobody released run here again."""
        o = self.outgoing.pop(tid, None)
        if o is None:
            return
        self._remember(self.out_done, tid, check_transition(o.state, state))
        if o.pushing is not None:  # its round is no longer wanted by anyone
            o.pushing.cancel()
        await self._resume(o.paused)

    # ---- target ---------------------------------------------------------------------------------------
    def open_import(self, tid: str, source: str | None = None, declared: int | None = None,
                    loop: asyncio.AbstractEventLoop | None = None, reading: bool = False) -> Incoming:
        """The transfer a new import round adds to (created by its first round). Any thread: from
        one that is not the loop's, `loop` is given (the sweeper starts there). `reading`: a round
        starts reading into it (`_round_ended` counts it out)."""
        if declared is not None and declared > self.import_limit:
            raise ImportTooLarge(f"transfer round of {declared} bytes exceeds this replica's import limit of "
                                 f"{self.import_limit}")
        with self._lock:
            i = self.incoming.get(tid)
            new = i is None
            if i is None:
                if tid in self.in_done:
                    raise TransferConflict(f"transfer {tid} already ended ({self.in_done[tid]})")
                if len(self.incoming) >= self.max_transfers:
                    raise TooManyTransfers("too many transfers in flight")
                i = self.incoming[tid] = Incoming(tid, self.clock(), source)
            elif i.final:
                raise TransferConflict(f"transfer {tid} already ran its final round")
            i.last = self.clock()
            i.receiving += reading
        if new:
            with contextlib.suppress(RuntimeError):  # (a closed loop: the replica is shutting down)
                loop.call_soon_threadsafe(self._ensure_sweeper) if loop is not None else self._ensure_sweeper()
        return i

    async def import_round(self, tid: str, pieces: AsyncIterator[bytes] | ReadInto, final: bool = False,
                           source: str | None = None, declared: int | None = None,
                           header: dict[str, int] | None = None) -> dict:
        """Receive one round's frames from `pieces` and import them. `pieces` is the byte pieces as
        they arrive (an HTTP body, a Mooncake ring), or a `read_into(view) -> n` that fills buffers
        itself (a socket: the round is then `import_link_round`'s, on a round worker). A round cut
        in pre-copy (`RoundCut` from `pieces`) keeps what arrived (chunks verified on receipt) and
        the reservations, so the migrator can resume from the acknowledged chunks, and the lease
        frees everything if it never comes back; any other failure drops the transfer."""
        if callable(pieces):
            return await on_worker(self.import_link_round, tid, pieces, final, source, header,
                                   asyncio.get_running_loop(), background=not final)
        i = self.open_import(tid, source, declared, reading=True)
        try:
            recv = StreamReceiver(i.store, max_frame_bytes=self.frame_limit, verify=False)  # hashed as imported
            t0, cpu0 = time.perf_counter(), self.cpu()
            manifest = await receive_round_bytes(i, recv, pieces, self.import_limit, self.clock)
            res, t1, t2 = await self._import(i, manifest, final)
            self._imported(i, recv, manifest, res, (t0, t1, t2), cpu0)
        except BaseException as e:
            if not (isinstance(e, RoundCut) and not final):  # (see _failed)
                await asyncio.shield(self.drop_incoming(tid, IncomingState.ABORTED))
            self._failed(i, e)
            raise
        finally:
            if self._round_ended(i):
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.ops.abort(i))
        return self._finished(i, res, final)

    def import_link_round(self, tid: str, read_into: ReadInto, final: bool, source: str | None,
                          header: dict[str, int] | None, loop: asyncio.AbstractEventLoop,
                          go_on: Callable[[], None] | None = None) -> dict:
        """`import_round` for a socket, run on the thread that reads it (the frame link's round worker):
        the round is opened here; its header's sessions (id -> KV tokens) get their blocks reserved by
        one engine-thread call that the reading does not wait for (migrate.protocol.engine_ops.placer);
        `go_on` tells the source to send; each chunk is read by this thread straight into its
        session's blocks (or staged, where none are reserved yet); only the manifest's import goes
        through `loop` to the engine thread and back (docs/protocol.md#the-path-a-byte-takes)."""
        i = self.open_import(tid, source, None, loop, reading=True)

        def on_loop(coro: Awaitable) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, loop).result()

        def on_loop_quietly(coro: Awaitable) -> None:  # (a failure's cleanup: the failure is what is reported)
            try:
                on_loop(coro)
            except Exception:  # noqa: BLE001 - e.g. the loop closed under a replica shutting down
                if asyncio.iscoroutine(coro):
                    coro.close()

        try:
            place = self.ops.placer(i, header or {}, loop)
            recv = StreamReceiver(i.store, max_frame_bytes=self.frame_limit, verify=False, place=place)
            if go_on is not None:
                go_on()
        except BaseException:  # nothing was read (the source went away before the go-ahead): the transfer stays as it was
            if self._round_ended(i):
                on_loop_quietly(self.ops.abort(i))
            raise
        try:
            t0, cpu0 = time.perf_counter(), self.cpu()
            manifest = read_round_bytes(i, recv, read_into, self.import_limit, self.clock)
            res, t1, t2 = on_loop(self._import(i, manifest, final))
            self._imported(i, recv, manifest, res, (t0, t1, t2), cpu0)
        except BaseException as e:
            if not (isinstance(e, RoundCut) and not final):  # (see _failed)
                on_loop_quietly(self.drop_incoming(tid, IncomingState.ABORTED))
            self._failed(i, e)
            raise
        finally:
            if self._round_ended(i):
                on_loop_quietly(self.ops.abort(i))
        return self._finished(i, res, final)

    # what the two forms of a round share
    async def _import(self, i: Incoming, manifest: Manifest, final: bool) -> tuple[dict, float, float]:
        """The manifest's import (on the loop: the engine thread's call), with when it began and ended."""
        t1 = time.perf_counter()
        if i.closed:  # dropped (aborted, expired) while its bytes arrived: nothing more is done for it
            raise TransferConflict(f"transfer {i.transfer_id} ended while its round arrived")
        return await self.ops.receive(i, manifest, final), t1, time.perf_counter()

    def _imported(self, i: Incoming, recv: StreamReceiver, manifest: Manifest, res: dict,
                  times: tuple[float, float, float], cpu0: float) -> None:
        t0, t1, t2 = times
        res["timing"] = {"receive_ms": round((t1 - t0) * 1000, 2), "import_ms": round((t2 - t1) * 1000, 2),
                         # from its first byte to its KV in the pool; chunks placed there as they arrived
                         "cpu_s": round(self.cpu() - cpu0, 4), "chunks": recv.chunks_received,
                         "placed_chunks": recv.chunks_placed}
        i.store.forget_imported(manifest, i.upto, recv.bytes_received)
        i.last = self.clock()

    def _finished(self, i: Incoming, res: dict, final: bool) -> dict:
        """A round imported and counted out: a final one's transfer is placed (from now on a commit may
        end it, which a round still counted in would take for a drop, and free what it placed)."""
        with self._lock:
            if i.closed:  # dropped between its import and here
                raise TransferConflict(f"transfer {i.transfer_id} ended while its round was imported")
            if final:
                i.final = True
        if final:
            res["placed"] = list(i.placed)
        return res

    def _failed(self, i: Incoming, e: BaseException) -> None:
        """A round that failed has dropped its transfer (nothing stays reserved for a garbled or
        refused round), but for a pre-copy round cut on the way: kept for its resume (its lease
        ends it else). Raises the refusal a byte limit means."""
        i.last = self.clock()
        if isinstance(e, LimitExceeded):
            raise ImportTooLarge(f"transfer {i.transfer_id} sent more than this replica's import limit of "
                                 f"{self.import_limit} bytes") from None

    def _round_ended(self, i: Incoming) -> bool:
        """A round of `i` stopped reading; True: it was the last one writing into a transfer dropped
        meanwhile, whose blocks are freed now (engine.moves.kv_stream: never while a sink may write)."""
        with self._lock:
            i.receiving -= 1
            return i.closed and not i.receiving

    async def commit(self, tid: str) -> dict:
        """Target, the second phase: the source has released the sessions; they run here from now
        on. Idempotent: a repeated commit answers `already: committed`."""
        if tid not in self.incoming:
            if self.in_done.get(tid) == IncomingState.COMMITTED:
                return {"sessions": [], "already": IncomingState.COMMITTED}
            if tid in self.in_done:
                raise TransferConflict(f"no incoming transfer {tid!r} ({self.in_done[tid]})")
            raise UnknownTransfer(f"no incoming transfer {tid!r}")
        if not self.incoming[tid].final:
            raise TransferConflict(f"transfer {tid} has not run its final round")
        return {"sessions": await self._commit_now(tid)}

    async def _commit_now(self, tid: str) -> list[str]:
        with self._lock:  # (a link round's open_import sees it in one table or the other, never in neither)
            i = self.incoming.pop(tid)
            i.closed = True  # (nothing more is reserved for it: engine.moves.receive.reserve_ahead)
            self._remember(self.in_done, tid, check_transition(i.state, IncomingState.COMMITTED))
        return await self.ops.commit(i)

    async def drop_incoming(self, tid: str, state: IncomingState) -> None:
        """Target: free the reservations and uncommitted sessions of a transfer."""
        with self._lock:
            i = self.incoming.pop(tid, None)
            if i is None:
                return
            self._remember(self.in_done, tid, check_transition(i.state, state))
            i.closed = True
            if i.receiving:  # a round's bytes may still go into its blocks (engine.moves.kv_stream): it frees them as it ends
                return
        with contextlib.suppress(Exception):  # a dead engine holds nothing any more
            await self.ops.abort(i)

    # ---- either side ------------------------------------------------------------------------------
    async def abort(self, tid: str) -> None:
        """Forget the transfer: the source resumes what it paused and did not release, the target
        frees reservations and uncommitted sessions."""
        await self.end_outgoing(tid, OutgoingState.ABORTED)
        await self.drop_incoming(tid, IncomingState.ABORTED)

    # ---- the sweeper ---------------------------------------------------------------------------------
    async def sweep(self) -> None:
        """End every transfer whose lease lapsed (see the module docstring); one pass."""
        now, ttl = self.clock(), self.ttl()
        for tid, o in list(self.outgoing.items()):
            if now - o.last > ttl:
                await self.end_outgoing(tid, OutgoingState.EXPIRED)
        for tid, i in list(self.incoming.items()):
            if now - i.last <= ttl:
                continue
            if not i.final:
                await self.drop_incoming(tid, IncomingState.EXPIRED)
                continue
            if now - i.last <= 2 * ttl:  # by then the source has either released or resumed them
                continue
            i.first_doubt = i.first_doubt or now
            verdict = await self._ask(tid, i)
            if tid not in self.incoming:
                continue
            if verdict == "commit":
                await self._commit_now(tid)
            elif verdict == "abort" or now - i.first_doubt > DOUBT_GIVE_UP * ttl:
                await self.drop_incoming(tid, IncomingState.EXPIRED)

    async def _ask(self, tid: str, i: Incoming) -> str | None:
        """In doubt (placed, no commit, the migrator gone): "commit", "abort", or None (no answer yet)."""
        if i.source is None or self.ask_source is None:
            return "abort"  # nobody to ask: the source's lease expired and it resumed them
        try:
            state = await self.ask_source(i.source, tid)
        except Exception:  # noqa: BLE001 - unreachable, or not a replica: keep asking
            return None
        if state == OutgoingState.RELEASED or state is None:  # None: the source restarted; this copy is the only one
            return "commit"
        if state in (OutgoingState.ABORTED, OutgoingState.EXPIRED):
            return "abort"
        return None  # still active on the source

    async def run_sweeper(self) -> None:
        """Sweep while there are transfers (a task started by the first transfer)."""
        while self.outgoing or self.incoming:
            await asyncio.sleep(min(1.0, self.ttl() / 4))
            try:
                await self.sweep()
            except Exception:  # noqa: BLE001 - keep sweeping
                pass

    def _ensure_sweeper(self) -> None:
        if self.autosweep and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.get_running_loop().create_task(self.run_sweeper())

    # ---- helpers ---------------------------------------------------------------------------------------
    async def _resume(self, ids: list[str]) -> None:
        with contextlib.suppress(Exception):  # a dead engine has nothing left to resume
            if ids:
                await self.ops.resume(ids)

    @staticmethod
    def _remember(done: OrderedDict, tid: str, state: OutgoingState | IncomingState) -> None:
        done[tid] = state
        done.move_to_end(tid)
        while len(done) > DONE_KEEP:
            done.popitem(last=False)
