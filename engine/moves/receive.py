"""The target's engine-thread half of a live transfer: reserve KV blocks for incoming sessions,
import the KV each round brought, place the sessions (held paused) in the final round, and
either commit them (they run here) or drop them (nothing stays reserved).

The transfer's record belongs to the protocol (migrate.protocol.transfers); these functions read and
update only its KV bookkeeping, described by `IncomingKV`."""

from __future__ import annotations

from typing import Protocol

from relayout.engine.kv_cache import blocks_needed
from relayout.engine.moves.kv_import import import_range
from relayout.engine.moves.kv_stream import Placed, placed_key
from relayout.engine.moves.placer import Reserved, SessionPlacer, check_compatible, check_entry
from relayout.engine.moves.snapshot import RestoreError
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SessionStatus
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.manifest import Manifest
from relayout.storage.stores.base import Store

# new reservations are this many blocks larger: the tokens the source decodes while pre-copy goes on
HEADROOM_BLOCKS = 2


class IncomingKV(Protocol):
    """What the target's engine keeps per incoming transfer."""

    store: Store  # the chunks received so far (verified), staged until imported
    blocks: Reserved  # session id -> (attention-DP group, reserved blocks)
    upto: dict[str, int]  # session id -> KV tokens already imported into those blocks
    placed: list[str]  # sessions the final round placed here (held paused until the commit)


def receive_round(engine: LLMEngine, t: IncomingKV, manifest: Manifest, final: bool) -> dict:
    """Target, engine thread: reserve blocks for new sessions, import KV that arrived, and in the
    final round place the sessions (paused until the source commits). Refusals free nothing
    the replica had before."""
    check_compatible(engine, manifest)
    check_placed(manifest, t.store.placed)  # chunks written as they arrived: the manifest's own
    placer = SessionPlacer(engine)
    # the checks a restore makes too (ids, vocabulary, context length, KV no longer than the tokens);
    # a session this transfer reserved for is its own, not "already live"
    states = {}
    for e in manifest.sessions:
        if e.state_from:  # only a standby takes such a round, made whole first (Manifest.with_whole_states)
            raise CorruptCheckpoint(f"session {e.session_id}: its state continues an earlier round's (state_from)")
        if e.kv_from > t.upto.get(e.session_id, 0):  # a delta round must continue exactly what this replica holds
            raise CorruptCheckpoint(f"session {e.session_id}: this round's KV starts at token {e.kv_from}, this "
                                    f"replica holds {t.upto.get(e.session_id, 0)} of it")
        states[e.session_id] = (check_entry(engine, e), e.num_kv_tokens)
    # 1. room first, for every session, before importing anything
    for sid, (st, n_kv) in states.items():
        placer.reserve(t.blocks, sid, blocks_needed(max(n_kv, st.num_tokens) + 1), HEADROOM_BLOCKS)
        t.upto.setdefault(sid, 0)
    # the gather buffers of a step over the incoming sessions, grown and touched now (in pre-copy), not
    # in their first step here, which is part of their stall; a dead rank is found here, before any ack
    for g in {t.blocks[sid][0] for sid in states}:
        engine.executor.reserve_kv_scratch(g, sum(len(b) for gg, b in t.blocks.values() if gg == g))
    # 2. import what arrived
    imported = 0
    for sid, (_st, n_kv) in states.items():
        g, blocks = t.blocks[sid]
        import_range(engine, t.store, manifest, sid, g, blocks, t.upto[sid], n_kv)
        imported += n_kv - t.upto[sid]
        t.upto[sid] = n_kv
    # 3. final: the sessions exist here now, held until the source commits
    if final:
        for sid, (st, n_kv) in states.items():
            g, blocks = placer.claim(t.blocks, sid)
            placer.place(st, n_kv, g, blocks, SessionStatus.PAUSED)
            t.placed.append(sid)
        engine.prestep(list(states))  # their next token while the commit travels, kept back until it lands
    return {"sessions": sorted(states), "imported_tokens": imported}


def reserve_ahead(engine: LLMEngine, blocks: Reserved, header: dict[str, int]) -> None:
    """Engine thread: blocks in a transfer's reservations for the sessions of a round's header (session
    -> its KV tokens) that hold none yet, before the round's chunks arrive, so that they go straight
    into them (engine.moves.kv_stream); the round's import checks and grows them, its end frees them.
    A session whose figure the manifest's checks will refuse gets nothing; once there is no room, nor do
    the ones after it (one call, bounded by the pool, however long the header): their chunks are staged."""
    placer = SessionPlacer(engine)
    for sid, kv_tokens in header.items():
        if sid in blocks or type(kv_tokens) is not int or not 0 < kv_tokens <= engine.max_model_len:
            continue
        try:
            placer.reserve(blocks, sid, blocks_needed(kv_tokens + 1), HEADROOM_BLOCKS)
        except RestoreError:
            return


def check_placed(manifest: Manifest, placed: Placed) -> None:
    """Every chunk a round placed as it arrived is an entry of its manifest, with the same bytes
    (hash): a sink checks its bytes against the hash its frame named, and only the manifest says
    what the round is. Anything else (a chunk no entry names, another entry's bytes) refuses the
    round before any session is placed; its blocks are the transfer's own, freed with it."""
    listed = {placed_key(e): e.chunk.hash for e in manifest.kv_entries}
    for key, (h, _, _) in placed.items():
        if listed.get(key) != h:
            raise CorruptCheckpoint(f"chunk {h}: placed as session {key[0]} layer {key[1]} heads [{key[2]}, {key[3]}) "
                                    f"tokens [{key[4]}, {key[5]}), which the round's manifest does not list so")


def free_reservations(engine: LLMEngine, t: IncomingKV) -> None:
    """Give back blocks reserved for sessions the final round did not place."""
    SessionPlacer(engine).release(t.blocks)


def abort_incoming(engine: LLMEngine, t: IncomingKV) -> None:
    """Target, engine thread: release reservations and drop sessions not yet committed."""
    free_reservations(engine, t)
    for sid in t.placed:
        engine.discard(sid)
    t.placed.clear()


def commit_incoming(engine: LLMEngine, t: IncomingKV) -> list[str]:
    """Target, engine thread: the source released the sessions; the placed ones run here from
    now on (spare reservations, e.g. of sessions that finished on the source meanwhile, are freed)."""
    free_reservations(engine, t)
    engine.resume(t.placed)
    return list(t.placed)
