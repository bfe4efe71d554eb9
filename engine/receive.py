"""The target's engine-thread half of a live transfer: reserve KV blocks for incoming sessions,
import the KV each round brought, place the sessions (held paused) in the final round, and
either commit them (they run here) or drop them (nothing stays reserved).

The transfer's record belongs to the protocol (migrate.transfers); these functions read and
update only its KV bookkeeping, described by `IncomingKV`."""

from __future__ import annotations

from typing import Protocol

import torch
from relayout.engine.engine import LLMEngine
from relayout.engine.kv_cache import blocks_needed, copy_into
from relayout.engine.session import SessionState, SessionStatus
from relayout.engine.snapshot import RestoreError, check_compatible, host_pools
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.manifest import Manifest
from relayout.storage.store_base import Store

IMPORT_SLICE_TOKENS = 256  # tokens imported through a multi-rank executor at a time


class IncomingKV(Protocol):
    """What the target's engine keeps per incoming transfer."""

    store: Store  # the chunks received so far (verified), staged until imported
    blocks: dict[str, tuple[int, list[int]]]  # session id -> (attention-DP group, reserved blocks)
    upto: dict[str, int]  # session id -> KV tokens already imported into those blocks
    placed: list[str]  # sessions the final round placed here (held paused until the commit)


def import_range(engine: LLMEngine, store: Store, manifest: Manifest, sid: str, group: int, blocks: list[int],
                 a: int, b: int) -> None:
    """Import tokens [a, b) of one session from whichever chunks cover them. `store` holds only
    chunks verified on receipt (storage.stream.StreamReceiver): their hashes are not computed again."""
    from relayout.storage.chunks import kv_scaled_view, kv_view

    if b <= a:
        return
    c = engine.cfg
    entries = [e for e in manifest.kv_entries if e.session_id == sid and e.tok_hi > a and e.tok_lo < b]
    covered = sum((min(b, e.tok_hi) - max(a, e.tok_lo)) * (e.head_hi - e.head_lo) for e in entries)
    if covered != c.num_layers * c.num_kv_heads * (b - a):  # before anything is fetched or written
        raise CorruptCheckpoint(f"session {sid}: chunks do not cover tokens [{a}, {b}) exactly once")
    pools = host_pools(engine, group, every_copy=True)
    scaled = manifest.kv.scale is not None
    if scaled and (pools is None or len(pools) != 1):  # check_compatible refuses this before any block is reserved
        raise RestoreError("fp8 KV moves only into a replica whose KV pool is local host memory (one rank, CPU)")
    views = []
    for e in entries:
        data, scale = store.get_chunk(e.chunk.hash), None
        if scaled:
            t, scale = kv_scaled_view(data, e.chunk, e.shape(c.head_dim), manifest.kv.dtype, verified=True)
        else:
            t = kv_view(data, e.chunk, e.shape(c.head_dim), engine.dtype, manifest.format_version, verified=True)
        views.append((e, t, scale))
    if pools is not None:  # straight from each chunk into the blocks of every pool holding its heads
        for e, t, scale in views:
            lo, hi = max(a, e.tok_lo), min(b, e.tok_hi)
            for pool, (p_lo, p_hi) in pools:
                h0, h1 = max(p_lo, e.head_lo), min(p_hi, e.head_hi)
                if h0 < h1:
                    part = t[:, h0 - e.head_lo : h1 - e.head_lo, lo - e.tok_lo : hi - e.tok_lo]
                    sc = None if scale is None else scale[:, h0 - e.head_lo : h1 - e.head_lo, lo - e.tok_lo : hi - e.tok_lo]
                    pool.import_from(blocks, e.layer, lo, part, h0 - p_lo, sc)
        return
    # through the executor, IMPORT_SLICE_TOKENS at a time through one reused buffer: a whole round
    # assembled at once would be that much fresh memory (page faults) here and in every rank. The
    # buffer is token-major like the chunks and the pool, so every copy on the way moves whole rows.
    buf = torch.empty((c.num_layers, 2, min(IMPORT_SLICE_TOKENS, b - a), c.num_kv_heads, c.head_dim),
                      dtype=engine.dtype)
    for s0 in range(a, b, IMPORT_SLICE_TOKENS):
        s1 = min(b, s0 + IMPORT_SLICE_TOKENS)
        rows = buf[:, :, : s1 - s0]
        for e, t, _ in views:
            lo, hi = max(s0, e.tok_lo), min(s1, e.tok_hi)
            if lo < hi:
                copy_into(rows[e.layer, :, lo - s0 : hi - s0, e.head_lo : e.head_hi],
                          t[:, :, lo - e.tok_lo : hi - e.tok_lo].transpose(1, 2))
        engine.executor.import_kv(group, blocks, s0, rows.transpose(2, 3))


def receive_round(engine: LLMEngine, t: IncomingKV, manifest: Manifest, final: bool) -> dict:
    """Target, engine thread: reserve blocks for new sessions, import KV that arrived, and in the
    final round place the sessions (paused until the source commits). Refusals free nothing
    the replica had before."""
    check_compatible(engine, manifest)
    c = engine.cfg
    states = {e.session_id: (SessionState.from_dict(e.state), e.num_kv_tokens) for e in manifest.sessions}
    for e in manifest.sessions:  # a delta round must continue exactly what this replica holds
        if e.kv_from > t.upto.get(e.session_id, 0):
            raise CorruptCheckpoint(f"session {e.session_id}: this round's KV starts at token {e.kv_from}, this "
                                    f"replica holds {t.upto.get(e.session_id, 0)} of it")
    # 1. room first, for every session, before importing anything
    for sid, (st, n_kv) in states.items():
        if any(x >= c.vocab_size for x in st.all_token_ids):
            raise CorruptCheckpoint(f"session {sid} holds token ids outside the vocabulary")
        need = blocks_needed(max(n_kv, st.num_tokens) + 1)
        if sid not in t.blocks:
            old = engine.sessions.get(sid)
            if old is not None and not old.is_finished:
                raise RestoreError(f"session {sid} is already live on this replica")
            # headroom for the tokens the source decodes while pre-copy goes on
            want = need + 2
            cands = sorted(range(len(engine.allocators)), key=lambda g: (engine.scheduler.group_load(g), g))
            g = next((g for g in cands if engine.allocators[g].can_allocate(want)), None)
            if g is None:
                raise RestoreError(f"not enough free KV blocks for session {sid}: needs {want}, "
                                   f"largest free pool has {max(a.num_free for a in engine.allocators)}")
            t.blocks[sid] = (g, engine.allocators[g].allocate(want))
            t.upto[sid] = 0
        g, blocks = t.blocks[sid]
        if need > len(blocks):
            if not engine.allocators[g].can_allocate(need - len(blocks)):
                raise RestoreError(f"not enough free KV blocks for session {sid} to grow to {need}")
            blocks += engine.allocators[g].allocate(need - len(blocks))
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
            g, blocks = t.blocks.pop(sid)
            st.num_computed = n_kv
            st.status = SessionStatus.PAUSED
            engine.adopt(st, g, blocks)
            t.placed.append(sid)
        engine.prestep(list(states))  # their next token while the commit travels, kept back until it lands
    return {"sessions": sorted(states), "imported_tokens": imported}


def free_reservations(engine: LLMEngine, t: IncomingKV) -> None:
    """Give back blocks reserved for sessions the final round did not place."""
    for g, blocks in t.blocks.values():
        engine.allocators[g].free(blocks)
    t.blocks.clear()


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
