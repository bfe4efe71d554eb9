"""Session checkpoints out of and into a replica of any layout.

`take_snapshot` runs on the engine thread at a step boundary and only copies (session
state + KV tensors to host memory), so other sessions stall for at most that copy.
`write_snapshot` (any thread) encodes the copy into the storage format: per session, per
layer, per KV-head range, per token range. Token ranges are aligned to CHUNK_TOKENS so
successive checkpoints of a growing session share their full chunks (stored once).
`restore` checks everything before touching the target replica, then imports.
"""

from __future__ import annotations

import copy
import secrets
import time
from dataclasses import dataclass, field

import torch

from engine.engine import LLMEngine
from engine.kv_cache import blocks_needed
from engine.session import SessionState, SessionStatus
from storage.checkpoint import CheckpointReader, CheckpointWriter
from storage.chunks import dtype_name
from storage.errors import CorruptCheckpoint, ModelMismatch
from storage.manifest import KVGeometry, Manifest, ModelRef

CHUNK_TOKENS = 256  # a multiple of the KV block size


class RestoreError(ValueError):
    """The checkpoint cannot go into this replica (room, ids, geometry); nothing was changed."""


@dataclass
class SessionSnapshot:
    state: SessionState
    num_kv_tokens: int
    # one entry per distinct KV-head range the source holds: (head_lo, head_hi, [layers, 2, heads, tokens, d])
    kv: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)


def _live(engine: LLMEngine, session_ids: list[str] | None) -> list[SessionState]:
    if session_ids is None:
        return [s for s in engine.sessions.values() if not s.is_finished]
    out = []
    for sid in session_ids:
        s = engine.sessions.get(sid)
        if s is None:
            raise KeyError(f"session {sid} is not on this replica")
        if not s.is_finished:  # one that finished meanwhile has nothing left to move
            out.append(s)
    return out


def take_snapshot(engine: LLMEngine, session_ids: list[str] | None = None, tok_from: dict[str, int] | None = None,
                  tok_cap: int | None = None) -> list[SessionSnapshot]:
    """Consistent cut of sessions at this step boundary (call between two steps).

    `tok_from` skips KV a receiver already has (pre-copy rounds): only tokens from that
    index on are copied. `tok_cap` copies at most that many tokens per session, so a
    pre-copy round holds the engine thread (and every other session's decoding) only for
    a bounded copy; later rounds send the rest."""
    snaps = []
    for s in _live(engine, session_ids):
        lo = (tok_from or {}).get(s.session_id, 0)
        n = s.num_computed if tok_cap is None else min(s.num_computed, lo + tok_cap)
        snap = SessionSnapshot(copy.deepcopy(s), n)
        table = engine.scheduler.tables.get(s.session_id)
        if n > lo and table is not None:
            snap.kv = engine.executor.export_kv(s.dp_group, table.blocks[: blocks_needed(n)], lo, n)
        snaps.append(snap)
    return snaps


def model_ref(engine: LLMEngine) -> ModelRef:
    return ModelRef(name=engine.model_ref, fingerprint=engine.fingerprint, config=engine.cfg.to_dict())


def geometry(engine: LLMEngine) -> KVGeometry:
    c = engine.cfg
    return KVGeometry(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                      dtype=dtype_name(engine.dtype))


def write_snapshot(snaps: list[SessionSnapshot], writer: CheckpointWriter, tok_from: dict[str, int] | None = None
                   ) -> None:
    """Put every session's KV chunks and state into `writer` (commit is the caller's)."""
    for snap in snaps:
        sid = snap.state.session_id
        lo0 = (tok_from or {}).get(sid, 0)
        for head_lo, head_hi, kv in snap.kv:
            n = kv.shape[3]
            # chunk boundaries at absolute multiples of CHUNK_TOKENS
            t = lo0
            while t < lo0 + n:
                t_end = min(lo0 + n, (t // CHUNK_TOKENS + 1) * CHUNK_TOKENS)
                for layer in range(kv.shape[0]):
                    part = kv[layer, :, :, t - lo0 : t_end - lo0]
                    writer.put_kv(sid, layer, head_lo, head_hi, t, t_end, part)
                t = t_end
        writer.add_session(sid, snap.state.to_dict(), snap.num_kv_tokens)


def checkpoint(engine: LLMEngine, writer: CheckpointWriter, session_ids: list[str] | None = None,
               meta: dict | None = None) -> Manifest:
    """Synchronous checkpoint for code that owns the engine thread (tests, CLI, benches)."""
    snaps = take_snapshot(engine, session_ids)
    write_snapshot(snaps, writer)
    return writer.commit(model_ref(engine), engine.layout.to_dict(), geometry(engine), meta or {})


# ---- restore ------------------------------------------------------------------
def check_compatible(engine: LLMEngine, manifest: Manifest) -> None:
    if manifest.model.fingerprint != engine.fingerprint:
        raise ModelMismatch(
            f"checkpoint {manifest.checkpoint_id} is of model {manifest.model.name} "
            f"(fingerprint {manifest.model.fingerprint[:12]}), this replica serves {engine.model_ref} "
            f"(fingerprint {engine.fingerprint[:12]})"
        )
    g, kv = geometry(engine), manifest.kv
    if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (g.num_layers, g.num_kv_heads, g.head_dim):
        raise CorruptCheckpoint(f"checkpoint KV geometry {kv} does not match the model's {g}")


def plan_restore(engine: LLMEngine, manifest: Manifest, session_ids: list[str] | None = None
                 ) -> list[tuple[SessionState, int, int]]:
    """(state, num_kv_tokens, dp_group) for each session, or RestoreError; changes nothing."""
    entries = [manifest.session(sid) for sid in session_ids] if session_ids else manifest.sessions
    free = [a.num_free for a in engine.allocators]
    load = [engine.scheduler.group_load(g) for g in range(len(free))]
    out = []
    for e in entries:
        st = SessionState.from_dict(e.state)
        if st.session_id != e.session_id:
            raise CorruptCheckpoint(f"session entry {e.session_id} holds state of {st.session_id}")
        old = engine.sessions.get(st.session_id)
        if old is not None and not old.is_finished:
            raise RestoreError(f"session {st.session_id} is already live on this replica")
        if any(t >= engine.cfg.vocab_size for t in st.all_token_ids):
            raise CorruptCheckpoint(f"session {st.session_id} holds token ids outside the vocabulary")
        if st.num_tokens + st.sampling.max_tokens - len(st.output_token_ids) > engine.max_model_len:
            raise RestoreError(f"session {st.session_id} needs more context than this replica's {engine.max_model_len}")
        need = blocks_needed(st.num_tokens + 1) if e.num_kv_tokens else 0
        cands = sorted(range(len(free)), key=lambda g: (load[g], g))
        g = next((g for g in cands if free[g] >= need), None)
        if g is None:
            raise RestoreError(
                f"not enough free KV blocks for session {st.session_id}: needs {need}, "
                f"largest free pool has {max(free)}"
            )
        free[g] -= need
        load[g] += 1
        out.append((st, e.num_kv_tokens, g))
    return out


def restore(engine: LLMEngine, reader: CheckpointReader, session_ids: list[str] | None = None,
            verify: bool = True) -> list[str]:
    """Import sessions into this replica (engine thread, between steps). All checks first:
    a refused restore leaves the replica's sessions and blocks untouched."""
    m = reader.manifest
    check_compatible(engine, m)
    plan = plan_restore(engine, m, session_ids)
    if verify:
        reader.verify()  # every chunk hash, before anything is imported
    H = engine.cfg.num_kv_heads
    imported: list[str] = []
    for st, n_kv, g in plan:
        st.dp_group = g
        if n_kv == 0:
            st.num_computed = 0
            st.status = SessionStatus.WAITING
            engine.sessions[st.session_id] = st
            engine.scheduler.add(st)
            imported.append(st.session_id)
            continue
        blocks = engine.allocators[g].allocate(blocks_needed(st.num_tokens + 1))
        try:
            kv = torch.stack([reader.read_kv(st.session_id, layer, 0, H) for layer in range(engine.cfg.num_layers)])
            engine.executor.import_kv(g, blocks, 0, kv)
        except BaseException:
            engine.allocators[g].free(blocks)
            raise
        st.num_computed = n_kv
        st.status = SessionStatus.RUNNING
        engine.sessions[st.session_id] = st
        engine.scheduler.place(st, g, blocks)
        imported.append(st.session_id)
    return imported


def release(engine: LLMEngine, session_ids: list[str], status: SessionStatus = SessionStatus.MIGRATED) -> None:
    """The source's side of a commit: the sessions now live elsewhere; free their blocks."""
    for sid in session_ids:
        s = engine.sessions.get(sid)
        if s is not None and not s.is_finished:
            engine._finish(s, s.finish_reason or "migrated", status)


def new_checkpoint_id() -> str:
    return f"ckpt-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


# ---- live transfer (pre-copy rounds, then a final round) ------------------------------------------
@dataclass
class OutgoingTransfer:
    """Source side: what earlier rounds already sent."""

    transfer_id: str
    sent_upto: dict[str, int] = field(default_factory=dict)
    entries: list = field(default_factory=list)  # KVEntry of every chunk sent so far
    sent_hashes: set[str] = field(default_factory=set)
    rounds: int = 0


@dataclass
class IncomingTransfer:
    """Target side: blocks reserved for incoming sessions and how much KV is already in them."""

    transfer_id: str
    store: object  # storage.stores.MemoryStore staging chunks until imported
    blocks: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # sid -> (group, blocks)
    upto: dict[str, int] = field(default_factory=dict)
    placed: list[str] = field(default_factory=list)  # sessions imported by the final round (held paused)


def import_range(engine: LLMEngine, store, manifest: Manifest, sid: str, group: int, blocks: list[int],
                 a: int, b: int) -> None:
    """Import tokens [a, b) of one session from whichever chunks cover them."""
    from storage.chunks import unpack_kv

    if b <= a:
        return
    c = engine.cfg
    kv = torch.empty((c.num_layers, 2, c.num_kv_heads, b - a, c.head_dim), dtype=engine.dtype)
    covered = 0
    for e in manifest.kv_entries:
        if e.session_id != sid or e.tok_hi <= a or e.tok_lo >= b:
            continue
        t = unpack_kv(store.get_chunk(e.chunk.hash), e.chunk, e.shape(c.head_dim), engine.dtype)
        lo, hi = max(a, e.tok_lo), min(b, e.tok_hi)
        kv[e.layer, :, e.head_lo:e.head_hi, lo - a:hi - a] = t[:, :, lo - e.tok_lo:hi - e.tok_lo]
        covered += (hi - lo) * (e.head_hi - e.head_lo)
    if covered != c.num_layers * c.num_kv_heads * (b - a):
        raise CorruptCheckpoint(f"session {sid}: chunks do not cover tokens [{a}, {b}) exactly once")
    engine.executor.import_kv(group, blocks, a, kv)


def receive_round(engine: LLMEngine, t: IncomingTransfer, manifest: Manifest, final: bool) -> dict:
    """Target, engine thread: reserve blocks for new sessions, import KV that arrived, and in the
    final round place the sessions (paused until the source commits). Refusals free nothing
    the replica had before."""
    check_compatible(engine, manifest)
    c = engine.cfg
    states = {e.session_id: (SessionState.from_dict(e.state), e.num_kv_tokens) for e in manifest.sessions}
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
            engine.sessions[sid] = st
            engine.scheduler.place(st, g, blocks)
            t.placed.append(sid)
    return {"sessions": sorted(states), "imported_tokens": imported}


def abort_incoming(engine: LLMEngine, t: IncomingTransfer) -> None:
    """Target, engine thread: release reservations and drop sessions not yet committed."""
    for g, blocks in t.blocks.values():
        engine.allocators[g].free(blocks)
    t.blocks.clear()
    for sid in t.placed:
        s = engine.sessions.pop(sid, None)
        if s is not None:
            engine.scheduler.remove(s)
    t.placed.clear()
