"""The protocol's engine operations (migrate.protocol.transfers.EngineOps, the real one): each runs as
one function on the engine's thread, at a step boundary. `call` hands that function over:
AsyncEngine.call on a serving replica; a direct call where the caller owns the engine (tests)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from relayout.engine.moves.kv_stream import chunk_sink
from relayout.engine.moves.placer import SessionPlacer, check_compatible, kv_conversion, restore
from relayout.engine.moves.receive import abort_incoming, commit_incoming, receive_round, reserve_ahead
from relayout.engine.moves.snapshot import CHUNK_TOKENS, geometry, model_ref, take_snapshot
from relayout.engine.runtime.async_engine import AsyncEngine
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SessionState
from relayout.migrate.protocol.transfers import EngineOps, Incoming, SourceRound
from relayout.storage.checkpoint import CheckpointReader
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.manifest import ChunkRef, Manifest, ModelRef
from relayout.storage.settings import settings
from relayout.storage.stream import PayloadSink, Place

EngineCall = Callable[[Callable[[LLMEngine], Any]], Awaitable[Any]]


class EngineThreadOps:
    """`defer_copy`: a cut out of a host KV pool notes only which blocks hold the KV; the copy
    (and hashing) happens as the round is framed, on the frame producer's thread, while the
    engine keeps stepping (engine.moves.snapshot.DeferredKV)."""

    places_on_arrival = True  # a round's chunks go straight into the pool (placer)

    def __init__(self, call: EngineCall, note_migrated: Callable[[list[str], str], None] | None = None,
                 defer_copy: bool = False):
        self.call, self.note_migrated, self.defer_copy = call, note_migrated, defer_copy
        self.cut_engine_s = 0.0  # time the engine thread spent in cuts (the decode it held up), all together
        self.engine: LLMEngine | None = None  # set on a serving replica: a round's chunks go into its pools as they arrive
        self._model: tuple[LLMEngine, ModelRef] | None = None  # an engine's model never changes: built once

    @classmethod
    def of(cls, aengine: AsyncEngine, defer_copy: bool = False) -> EngineThreadOps:
        ops = cls(aengine.call, aengine.note_migrated, defer_copy)
        ops.engine = aengine.engine
        return ops

    def placer(self, t: Incoming, header: dict[str, int], loop: asyncio.AbstractEventLoop) -> Place | None:
        """A round's `place` (storage.stream), on the link's thread: a chunk of a session `t` holds
        blocks for goes straight into the pools (engine.moves.kv_stream), one of a session it holds
        none for is staged. The round's header (session -> KV tokens) has the engine thread reserve
        blocks for the sessions `t` holds none for yet: one call, posted through `loop` now and not
        waited for (not made at all if the transfer was dropped meanwhile)."""
        eng = self.engine
        if eng is None:
            return None
        t.store.placed.clear()  # this round's: a cut round's were never imported, and its resume resends them
        new = {sid: n for sid, n in header.items() if sid not in t.blocks}
        if new:
            async def ahead() -> None:
                with contextlib.suppress(Exception):  # no engine: the manifest's import says why
                    await self.call(lambda e: None if t.closed else reserve_ahead(e, t.blocks, new))

            asyncio.run_coroutine_threadsafe(ahead(), loop)

        def place(ref: ChunkRef, entry: dict) -> PayloadSink | None:
            return chunk_sink(eng, t.blocks, t.upto, t.store.placed, ref, entry)

        return place

    async def take_round(self, sessions: list[str] | None, pause: bool, sent: dict[str, int],
                  max_tokens: int | None) -> SourceRound:
        def cut(e: LLMEngine) -> SourceRound:
            t0 = time.perf_counter()
            paused: list[str] = []
            if pause:
                if sessions is None:
                    paused = [s.session_id for s in e.sessions.values() if not s.is_finished]
                else:
                    for sid in sessions:
                        if sid not in e.sessions:
                            raise KeyError(f"session {sid} is not on this replica")
                    # one that finished since the last round has nothing left to move
                    paused = [sid for sid in sessions if not e.sessions[sid].is_finished]
                e.pause(paused)
            # held sessions' KV cannot change before it is sent: a final round's chunks are sent from the pool
            snaps = take_snapshot(e, paused if pause else sessions, sent, max_tokens, self.defer_copy,
                                  in_place=pause and self.defer_copy)
            if self._model is None or self._model[0] is not e:
                self._model = (e, model_ref(e))
            out = SourceRound(paused, snaps, self._model[1], e.layout.to_dict(), geometry(e))
            self.cut_engine_s += time.perf_counter() - t0
            return out

        return await self.call(cut)

    async def take_checkpoint(self, sessions: list[str] | None, stop: bool) -> SourceRound:
        """A checkpoint's cut: the sessions' KV copied now (they may go on decoding); with `stop`, held."""
        def cut(e: LLMEngine) -> SourceRound:
            snaps = take_snapshot(e, sessions)
            if stop:
                e.pause([s.session_id for s in snaps])
            return SourceRound([s.session_id for s in snaps] if stop else [], snaps, model_ref(e), e.layout.to_dict(),
                       geometry(e))

        return await self.call(cut)

    async def restore(self, reader: CheckpointReader, sessions: list[str] | None, exact: bool
                      ) -> tuple[list[str], dict | None]:
        """Import sessions from a checkpoint: (their ids, the KV conversion if any). The cheap refusals
        first (model, geometry, ids, room), then every hash, before the engine is touched."""
        await self.call(lambda e: precheck_restore(e, reader.manifest, sessions))
        await asyncio.to_thread(reader.verify)
        return await self.call(lambda e: (restore(e, reader, sessions, verify=False, exact=exact),
                                          kv_conversion(e, reader.manifest)))

    async def load_outcomes(self, session_ids: list[str]) -> dict[str, str]:
        """Sessions whose restored KV was recomputed rather than imported: never here (the placer
        imports or refuses)."""
        return {}

    def import_limits(self, engine: LLMEngine) -> tuple[int, int]:
        return import_limits(engine)

    async def resume(self, session_ids: list[str]) -> None:
        await self.call(lambda e: e.resume(session_ids))

    async def release(self, session_ids: list[str], migrated_to: str | None) -> None:
        if migrated_to and self.note_migrated is not None:
            self.note_migrated(session_ids, migrated_to)
        await self.call(lambda e: e.release(session_ids))

    async def receive(self, t: Incoming, manifest: Manifest, final: bool) -> dict:
        return await self.call(lambda e: receive_round(e, t, manifest, final))

    async def commit(self, t: Incoming) -> list[str]:
        return await self.call(lambda e: commit_incoming(e, t))

    async def abort(self, t: Incoming) -> None:
        await self.call(lambda e: abort_incoming(e, t))


def import_limits(engine: LLMEngine) -> tuple[int, int]:
    """(bytes one incoming transfer may stage, all rounds together; largest frame). A transfer
    can never need more than the KV this replica could hold, so a stream that declares or
    sends more is refused before it is buffered. Reads only the engine's fixed facts."""
    import torch
    from relayout.engine.kv_cache import BLOCK_SIZE
    from relayout.storage.format.manifest import MAX_MANIFEST_BYTES

    c = engine.cfg
    item = torch.empty((), dtype=engine.dtype).element_size()
    tokens = engine.num_blocks * BLOCK_SIZE * engine.layout.attn_dp
    kv_bytes = tokens * c.num_layers * 2 * c.num_kv_heads * c.head_dim * item
    chunk = 2 * c.num_kv_heads * CHUNK_TOKENS * c.head_dim * item + (64 << 10)
    frame = max(MAX_MANIFEST_BYTES, 2 * chunk) + (1 << 20)
    limit = 2 * kv_bytes + MAX_MANIFEST_BYTES
    limit = settings().max_import_bytes or limit
    return limit, min(frame, limit)


def precheck_restore(engine: LLMEngine, manifest: Manifest, sessions: list[str] | None) -> None:
    """Refusals that need no chunk: model, geometry, ids, room, and KV no longer than the
    session's tokens (so no declared size can make verify() decode more than the replica holds)."""
    check_compatible(engine, manifest)
    SessionPlacer(engine).plan(manifest, sessions)
    for e in manifest.sessions:
        if sessions is None or e.session_id in sessions:
            n = SessionState.from_dict(e.state).num_tokens
            if e.num_kv_tokens > n:
                raise CorruptCheckpoint(f"session {e.session_id} declares {e.num_kv_tokens} KV tokens but holds "
                                        f"only {n} tokens")


def engine_ops_for(aengine: AsyncEngine, defer_copy: bool = False) -> EngineOps:
    """The protocol's engine operations for whichever engine serves the replica: the one place that asks."""
    if aengine.engine.engine_name == "vllm":
        from relayout.migrate.protocol.vllm_ops import VllmOps

        return VllmOps(aengine)
    return EngineThreadOps.of(aengine, defer_copy)
