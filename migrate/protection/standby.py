"""Protection, the standby's half: the copies of another replica's sessions, kept through the
live-transfer import machinery (engine.moves.receive: blocks reserved, KV imported round by round,
nothing placed, so this replica's own traffic keeps running), the source's lease, and promotion.

Promotion (idempotent) happens only when the lease has lapsed — the source stopped renewing it
longer ago than the source itself waits before it stops serving (migrate.protection.replication) — and the
source does not answer, or answers that it no longer serves them. The promoted sessions continue
from the last sync; tokens generated on the source after it (told by whoever triggers the
promotion: the gateway, a client) are appended, their KV recomputed by a short prefill, and the
sampler's generator advanced past them, so greedy and seeded sessions go on exactly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from relayout.engine.moves.placer import SessionPlacer
from relayout.engine.moves.receive import abort_incoming, free_reservations, receive_round
from relayout.engine.runtime.engine import LLMEngine, finish_reason_after
from relayout.engine.runtime.sampling import advance_rng
from relayout.engine.runtime.session import SessionState
from relayout.engine.tracing import span
from relayout.migrate.protocol.engine_ops import EngineCall
from relayout.migrate.protocol.states import AskSource, ProtectionState
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.manifest import ChunkRef, Manifest
from relayout.storage.stores import MemoryStore
from relayout.storage.stream import StreamReceiver

PROMOTE_MARGIN_S = 0.15  # a fence's pause overrunning the lease's end (a step longer than lately), clock drift
AUTO_GRACE_S = 0.5  # the standby's own promotion waits this much longer than one a caller triggers


class ProtectionError(Exception):
    status = 409
    type = "conflict"


class Promoted(ProtectionError):
    type = "protection_promoted"


class Dropped(ProtectionError):
    type = "protection_dropped"


class NotLapsed(ProtectionError):
    type = "lease_held"


class Diverged(ProtectionError):
    type = "tokens_diverged"


class StateGap(ProtectionError):
    type = "state_gap"


class UnknownProtection(ProtectionError):
    status = 404
    type = "not_found"


class StandbyChunks(MemoryStore):
    """The standby's chunks, held only until the round that brought them is imported into the
    reserved blocks: then only their hashes stay (a manifest may list a chunk imported already,
    and the stream receiver checks it holds every chunk listed), so the copies cost the KV pool's
    blocks and one round's chunks in RAM, not a second copy of every protected session's KV."""

    def __init__(self) -> None:
        super().__init__()
        self.imported: set[str] = set()

    def has_chunk(self, h: str) -> bool:
        return h in self.imported or super().has_chunk(h)

    def put_chunk(self, h: str, data: bytes, *, hashed: bool = False, ref: ChunkRef | None = None) -> None:
        self.imported.discard(h)  # sent again (another session's KV with the same bytes): keep them this time
        super().put_chunk(h, data, hashed=hashed, ref=ref)

    def staged_bytes(self) -> int:
        with self._lock:
            return sum(len(data) for data, _ in self._chunks.values())

    def drop_imported(self, manifest: Manifest, upto: dict[str, int]) -> None:
        """Free the bytes of every chunk the sessions' KV now holds (`upto`: tokens imported per session)."""
        listed = {e.chunk.hash for e in manifest.kv_entries}
        pending = {e.chunk.hash for e in manifest.kv_entries if e.tok_hi > upto.get(e.session_id, 0)}
        for h in listed - pending:
            if not self._is_pinned(h):
                self._delete_chunk(h)
                self.imported.add(h)
        self.imported &= listed  # a finished session's chunks are listed no more


def promote_after(lease_s: float) -> float:
    """How long the standby waits after the last round before it may promote: the source's lease,
    which it counts from before it cut the round (earlier than this replica's count, which starts
    once the round is imported) and by whose end it has paused the sessions (it fences ahead of
    the end by the step under way: migrate.protection.replication), plus PROMOTE_MARGIN_S."""
    return lease_s + PROMOTE_MARGIN_S


@dataclass
class Held:
    """The copies of one protection (engine.moves.receive.IncomingKV) and its lease."""

    pid: str
    source: str
    lease_s: float
    last: float
    store: StandbyChunks = field(default_factory=StandbyChunks)
    blocks: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    upto: dict[str, int] = field(default_factory=dict)
    placed: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    state: str = "standby"  # standby | promoted | dropped
    rounds: int = 0
    promoted: dict[str, int] = field(default_factory=dict)  # session -> tail tokens recomputed at promotion
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def lapsed(self, now: float) -> bool:
        return now - self.last > promote_after(self.lease_s)

    def view(self, now: float) -> dict:
        m = self.manifest
        return {"protection": self.pid, "source": self.source, "state": self.state, "rounds": self.rounds,
                "since_last_round_s": round(now - self.last, 3), "promote_after_s": promote_after(self.lease_s),
                "sessions": [{"id": e.session_id, "kv_tokens": e.num_kv_tokens,
                              "tokens": len(e.state["prompt_token_ids"]) + len(e.state["output_token_ids"]),
                              "output_tokens": len(e.state["output_token_ids"])}
                             for e in (m.sessions if m else [])],
                "tail_tokens": dict(self.promoted), "staged_bytes": self.store.staged_bytes()}


def tail_of(st: SessionState, told: list[int] | None) -> list[int]:
    """The generated tokens told beyond the synced ones (Diverged if they disagree with them)."""
    if not told:
        return []
    have = st.output_token_ids
    if told[: len(have)] != have[: len(told)]:
        raise Diverged(f"session {st.session_id}: the tokens told differ from the ones synced")
    return list(told[len(have):])


def place_promoted(e: LLMEngine, h: Held, told: dict[str, list[int]]) -> dict[str, int]:
    """Engine thread: the held sessions become this replica's, running; returns the tail tokens
    recomputed per session."""
    assert h.manifest is not None
    states = {x.session_id: (SessionState.from_dict(x.state), x.num_kv_tokens) for x in h.manifest.sessions}
    tails = {sid: tail_of(st, told.get(sid)) for sid, (st, _) in states.items()}  # all checked first
    out: dict[str, int] = {}
    placer = SessionPlacer(e)
    for sid, (st, n_kv) in states.items():
        tail = tails[sid] if st.sampling.logprobs is None else []  # logprobs: regenerate the tail instead
        if tail:
            advance_rng(st, e.cfg.vocab_size, len(tail))
            st.output_token_ids += tail
        g, blocks = placer.claim(h.blocks, sid, with_kv=n_kv > 0)  # none: not admitted on the source yet
        placer.place(st, n_kv, g, blocks)
        reason = finish_reason_after(st, st.output_token_ids[-1], e.tokenizer) if tail else None
        if reason is not None:
            e.abort(sid, reason)
        out[sid] = len(tail)
    free_reservations(e, h)
    return out


class PoolKeeper:
    """Where a builtin standby keeps the copies: blocks reserved in its own KV pool (engine.moves.receive)."""

    def __init__(self, call: EngineCall):
        self.call = call

    async def take(self, h: Held, manifest: Manifest) -> dict:
        def take(e: LLMEngine) -> dict:
            res = receive_round(e, h, manifest, final=False)
            gone = [sid for sid in h.blocks if sid not in res["sessions"]]
            SessionPlacer(e).release(h.blocks, gone)  # finished on the source: its copy is not needed any more
            for sid in gone:
                h.upto.pop(sid, None)
            return res

        return await self.call(take)

    async def promote(self, h: Held, told: dict[str, list[int]]) -> dict[str, int]:
        return await self.call(lambda e: place_promoted(e, h, told))

    async def drop(self, h: Held) -> None:
        await self.call(lambda e: abort_incoming(e, h))


class StandbyKeeper(Protocol):
    """Where a standby keeps its copies between rounds, and how they become running sessions: a
    builtin replica's KV pool (PoolKeeper), a vLLM replica's staged load files (migrate.protocol.vllm_ops)."""

    async def take(self, h: Held, manifest: Manifest) -> dict: ...  # {"sessions", "imported_tokens"[, "not_held"]}

    async def promote(self, h: Held, told: dict[str, list[int]]) -> dict[str, int]: ...  # tail tokens a session

    async def drop(self, h: Held) -> None: ...


class StandbyTable:
    """Every protection this replica is the standby of. Methods run on one asyncio loop."""

    def __init__(self, call: EngineCall, ask: AskSource, *, clock: Callable[[], float] = time.monotonic,
                 frame_limit: int = 1 << 30, round_limit: int = 1 << 62, autopromote: bool = True,
                 keeper: StandbyKeeper | None = None):
        self.call, self.ask, self.clock = call, ask, clock
        self.keeper: StandbyKeeper = keeper or PoolKeeper(call)
        self.frame_limit, self.round_limit, self.autopromote = frame_limit, round_limit, autopromote
        self.held: dict[str, Held] = {}
        self.ended: dict[str, str] = {}  # protection -> promoted | dropped (refuses later rounds)
        self._watcher: asyncio.Task | None = None

    def get(self, pid: str) -> Held:
        h = self.held.get(pid)
        if h is None:
            raise UnknownProtection(f"no protection {pid!r} on this standby ({self.ended.get(pid, 'unknown')})")
        return h

    # ---- rounds ---------------------------------------------------------------------------------------
    async def receive(self, pid: str, source: str, lease_s: float, pieces: AsyncIterator[bytes]) -> dict:
        """One round from the source: import it and renew the lease."""
        if self.ended.get(pid) == "promoted" or (pid in self.held and self.held[pid].state == "promoted"):
            raise Promoted(f"protection {pid} was promoted: this replica owns its sessions")
        if pid in self.ended:
            raise Dropped(f"protection {pid} was dropped here")
        h = self.held.get(pid)
        if h is None:
            h = self.held[pid] = Held(pid, source, lease_s, self.clock())
            self._ensure_watcher()
        recv = StreamReceiver(h.store, max_frame_bytes=self.frame_limit)
        n = 0
        async for piece in pieces:
            n += len(piece)
            if n > self.round_limit:
                raise ProtectionError(f"round of protection {pid} exceeds this replica's import limit")
            recv.feed(piece)
        manifest = recv.close()
        async with h.lock:
            if h.state != "standby":
                raise Promoted(f"protection {pid} was promoted while its round arrived")
            try:  # the states' lists it leaves out are the last round's (a source sends only what is new)
                manifest = manifest.with_whole_states(h.manifest)
            except CorruptCheckpoint as e:  # 409: the source sends the whole of every session again
                raise StateGap(f"protection {pid}: {e}") from None

            res = await self.keeper.take(h, manifest)
            h.store.drop_imported(manifest, h.upto)
            if h.manifest is not None and h.manifest.checkpoint_id != manifest.checkpoint_id:
                h.store.delete_checkpoint(h.manifest.checkpoint_id)  # keeps the chunks the new one lists
            h.manifest, h.source, h.lease_s, h.last = manifest, source, lease_s, self.clock()
            h.rounds += 1
        return {"protection": pid, "state": h.state, "sessions": res["sessions"],
                "imported_tokens": res["imported_tokens"], "promote_after_s": promote_after(lease_s),
                "not_held": res.get("not_held", {})}

    # ---- promotion --------------------------------------------------------------------------------------
    async def promote(self, pid: str, told: dict[str, list[int]] | None = None, wait: bool = True) -> dict:
        """Make the held sessions this replica's. Idempotent (a repeat checks the tokens told against
        what the sessions hold). With `wait`, waits for the lease to lapse first (for as long as one
        lease takes to lapse: a source that keeps renewing it is alive, and keeps its sessions)."""
        h = self.get(pid)
        if h.state == "promoted":
            return await self._promoted_view(h, told or {})
        if wait:
            until = self.clock() + promote_after(h.lease_s) + 0.5
            while h.state == "standby" and not h.lapsed(self.clock()) and self.clock() < until:
                await asyncio.sleep(max(0.01, min(until, h.last + promote_after(h.lease_s)) - self.clock() + 0.01))
        if h.state == "promoted":
            return await self._promoted_view(h, told or {})
        if not h.lapsed(self.clock()):
            raise NotLapsed(f"protection {pid}: the source renewed its lease "
                            f"{self.clock() - h.last:.2f}s ago; it still owns the sessions")
        try:
            answer = await self.ask(h.source, pid)
        except Exception:  # noqa: BLE001 - no answer: dead, or on the far side of a partition
            answer = None
        if answer == "stopped":
            await self.drop(pid)
            raise Dropped(f"protection {pid} was stopped on its source")
        if answer == ProtectionState.ACTIVE:
            raise NotLapsed(f"protection {pid}: the source answers that it still serves the sessions")
        async with h.lock:
            if h.state == "promoted":
                return await self._promoted_view(h, told or {})
            if not h.lapsed(self.clock()) or h.manifest is None:  # a round came in meanwhile
                raise NotLapsed(f"protection {pid}: the source renewed its lease")
            with span("failover-promote", protection=pid, sessions=len(h.manifest.sessions)):
                h.promoted = await self.keeper.promote(h, told or {})
            h.state = "promoted"
            self.ended[pid] = "promoted"
            h.store = StandbyChunks()  # the staged chunks are not needed any more
        return {**h.view(self.clock()), "sessions_promoted": sorted(h.promoted)}

    async def _promoted_view(self, h: Held, told: dict[str, list[int]]) -> dict:
        def check(e: LLMEngine) -> None:
            for sid, toks in told.items():
                s = e.sessions.get(sid)
                if s is not None:
                    n = min(len(s.output_token_ids), len(toks))
                    if s.output_token_ids[:n] != list(toks[:n]):
                        raise Diverged(f"session {sid}: the tokens told differ from the promoted session's")

        await self.call(check)
        return {**h.view(self.clock()), "sessions_promoted": sorted(h.promoted), "already": "promoted"}

    async def drop(self, pid: str) -> dict:
        """Free the copies (the source stopped protecting); a promoted protection stays promoted."""
        h = self.get(pid)
        async with h.lock:
            if h.state == "promoted":
                return {"protection": pid, "state": "promoted"}
            h.state = "dropped"
            self.held.pop(pid, None)
            self.ended[pid] = "dropped"
            await self.keeper.drop(h)
        return {"protection": pid, "state": "dropped"}

    # ---- the lease watcher -----------------------------------------------------------------------------
    async def watch(self) -> None:
        """Promote each protection whose lease lapsed (a little after a caller could have, so one
        that knows the tail tokens usually gets there first)."""
        while any(h.state == "standby" for h in self.held.values()):
            await asyncio.sleep(0.1)
            now = self.clock()
            for pid, h in list(self.held.items()):
                if h.state == "standby" and now - h.last > promote_after(h.lease_s) + AUTO_GRACE_S:
                    try:
                        await self.promote(pid, None, wait=False)
                    except Exception:  # noqa: BLE001 - the source answered, or a round came: look again later
                        pass

    def _ensure_watcher(self) -> None:
        if self.autopromote and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self.watch())
