"""Session checkpoints out of and into a replica of any layout.

`take_snapshot` runs on the engine thread at a step boundary and only copies (session
state + KV tensors to host memory), so other sessions stall for at most that copy; with
`defer_copy` (live transfers out of a host pool) it copies only the state and which blocks hold
the KV, and the KV is copied later, off the engine thread (`DeferredKV`).
`write_snapshot` (any thread) encodes the copy into the storage format: per session, per
layer, per KV-head range, per token range. Token ranges are aligned to CHUNK_TOKENS so
successive checkpoints of a growing session share their full chunks (stored once).
Restoring them is engine/moves/placer.py's.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Iterator

import torch
from relayout.engine.kv_cache import FP8_KV, KVCache, blocks_needed
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SessionState
from relayout.storage.checkpoint import CheckpointWriter
from relayout.storage.format.chunks import (
    KVChunk,
    dtype_name,
    keep_freed_memory,
    kv_chunk_hasher,
    new_kv_chunk,
    parallel_map,
    seal_kv_chunk,
)
from relayout.storage.format.manifest import KVGeometry, Manifest, ModelRef
from relayout.storage.format.pieces import in_place_chunk

CHUNK_TOKENS = 512  # a multiple of the KV block size


class RestoreError(ValueError):
    """The checkpoint cannot go into this replica (room, ids, geometry); nothing was changed."""


class KVMoved(RuntimeError):
    """The engine preempted a session while a deferred snapshot copied KV out of the pool: the
    blocks it was reading may hold another session's KV by now, so that copy is not trusted."""


@dataclasses.dataclass
class DeferredKV:
    """KV a snapshot copies after the cut, off the engine thread: tokens [lo, hi) of one session's
    `blocks` in a host pool. KV of computed positions never changes, so the engine may keep
    stepping meanwhile; blocks change owner only when a session ends (its KV is then not moved
    any more) or is preempted, which `check` detects through the scheduler's preemption count."""

    pools: list[tuple[KVCache, tuple[int, int]]]  # Executor.host_pools: each pool with the KV heads it holds
    blocks: list[int]
    lo: int
    hi: int
    engine: LLMEngine
    preemptions: int
    # the sessions are held until the round ends (a final round): chunks are the pool's rows as
    # they lie, hashed, not copied (storage.format.pieces); a change before they are sent fails their hash
    in_place: bool = False

    def check(self) -> None:
        if self.engine.scheduler.num_preemptions != self.preemptions:
            raise KVMoved("the source preempted a session while its KV was being copied out; retry the round")

    def batches(self) -> Iterator[list[tuple]]:
        """The chunks (as take_snapshot lays them out), one CHUNK_TOKENS range of every layer at a
        time: each copied (and hashed) on all cores, then checked still valid, then handed on. In
        place, one chunk at a time: hashed just before it is sent, which then reads it from this
        core's cache (`relayout bench datapath`'s sender: 0.144-0.146 CPU s/GB, against 0.160-0.164
        with chunks hashed up to 32 MiB ahead on another thread)."""
        for a, b in _chunk_ranges(self.lo, self.hi):
            if self.in_place:
                for pool, heads in self.pools:
                    for c in _in_place_chunks(pool, heads, self.blocks, a, b):
                        self.check()
                        yield [c]
                continue
            chunks = [c for pool, heads in self.pools for c in _export_chunks(pool, heads, self.blocks, a, b)]
            self.check()
            yield chunks


class SessionSnapshot:
    """One session cut at a step boundary: its state and a host copy of its KV.

    The KV is held either as `kv` — one entry per distinct KV-head range the source holds:
    (head_lo, head_hi, [layers, 2, heads, tokens, d]) — or, when the engine's pool is local host
    memory, as `chunks` already in their stored form (layer, head_lo, head_hi, tok_lo, tok_hi,
    KVChunk whose tensor is the payload of a chunk buffer, see storage.format.chunks.new_kv_chunk),
    so `write_snapshot` only stores them (hashed as they were copied); a quantised (fp8) pool's chunks
    carry a 7th element, their float32 [2, heads, tokens] scales, and exist only in this form. Reading `kv` of such a snapshot assembles it
    (a copy); setting `kv` replaces the chunks."""

    def __init__(self, state: SessionState, num_kv_tokens: int,
                 kv: list[tuple[int, int, torch.Tensor]] | None = None,
                 chunks: list[tuple] | None = None, deferred: DeferredKV | None = None) -> None:
        self.state = state  # at the cut, as the plain data a manifest carries (a copy: the session goes on)
        self.num_kv_tokens = num_kv_tokens
        self._kv = list(kv or [])
        self.chunks = chunks
        self.deferred = deferred  # the KV, not copied yet (take_snapshot's defer_copy)

    @property
    def state(self) -> SessionState:
        """The state at the cut (a new object each time: set it back to change the snapshot's)."""
        return SessionState.from_dict(self.state_dict)

    @state.setter
    def state(self, st: SessionState) -> None:
        self.state_dict, self.session_id = st.to_dict(), st.session_id

    def materialize(self) -> None:
        """Copy deferred KV now (into `chunks`)."""
        if self.deferred is not None:
            d, self.deferred = self.deferred, None
            self.chunks = [c for batch in d.batches() for c in batch]

    @property
    def kv(self) -> list[tuple[int, int, torch.Tensor]]:
        self.materialize()
        if self.chunks is None:
            return self._kv
        if any(len(c) > 6 for c in self.chunks):
            raise ValueError("a snapshot of quantised (fp8) KV holds it only as chunks with their scales")
        by_heads: dict[tuple[int, int], list] = {}
        for c in self.chunks:
            by_heads.setdefault((c[1], c[2]), []).append(c)
        out = []
        for (hlo, hhi), cs in by_heads.items():
            t0, t1 = min(c[3] for c in cs), max(c[4] for c in cs)
            layers = max(c[0] for c in cs) + 1
            ref = cs[0][5].view
            kv = torch.empty((layers, 2, hhi - hlo, t1 - t0, ref.shape[3]), dtype=ref.dtype)
            for layer, _, _, a, b, c in cs:
                kv[layer, :, :, a - t0 : b - t0] = c.view
            out.append((hlo, hhi, kv))
        return out

    @kv.setter
    def kv(self, value: list[tuple[int, int, torch.Tensor]]) -> None:
        self._kv = list(value)
        self.chunks = self.deferred = None


def _chunk_ranges(lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) cut at absolute multiples of CHUNK_TOKENS."""
    out, t = [], lo
    while t < hi:
        t_end = min(hi, (t // CHUNK_TOKENS + 1) * CHUNK_TOKENS)
        out.append((t, t_end))
        t = t_end
    return out


def _in_place_chunks(pool: KVCache, heads: tuple[int, int], blocks: list[int], lo: int, hi: int) -> Iterator[tuple]:
    """Held sessions' chunks of tokens [lo, hi) as the pool's own rows, each hashed where they lie
    (no copy) as it is taken (on this thread: handing slices to the chunk pool's threads cost more
    CPU than xxh3 itself, 0.14-0.155 CPU-s per GB sent against 0.186-0.198); the chunks copied
    instead where the pool cannot be viewed so."""
    k0 = pool.k[0]
    h, d = k0.shape[2], k0.shape[3]
    for a, b in _chunk_ranges(lo, hi):
        for layer in range(len(pool.k)):
            rows = pool.row_views(blocks, layer, a, b)
            made = None if rows is None else in_place_chunk((2, h, b - a, d), k0.dtype, rows)
            if made is None:  # (another device, dtype, or a quantised pool: the same for every layer)
                yield from (c for c in _export_chunks(pool, heads, blocks, a, b) if c[0] >= layer)
                break
            yield (layer, heads[0], heads[1], a, b, made)


def _export_chunks(pool: KVCache, heads: tuple[int, int], blocks: list[int], lo: int, hi: int) -> list[tuple]:
    k0 = pool.k[0]
    h, d = k0.shape[2], k0.shape[3]
    nbytes = len(pool.k) * 2 * h * d * (hi - lo) * k0.element_size()  # small (a replication round): inline
    if pool.quantised:  # (..., values, scales), both token-major like the pool and the stored chunk
        chunks: list[tuple] = [
            (layer, heads[0], heads[1], a, b, torch.empty((2, b - a, h, d), dtype=k0.dtype).transpose(1, 2),
             torch.empty((2, b - a, h)).transpose(1, 2))
            for a, b in _chunk_ranges(lo, hi) for layer in range(len(pool.k))]
        parallel_map(lambda c: pool.export_into(blocks, c[0], c[3], c[4], c[5], c[6]), chunks, nbytes)
        return chunks
    chunks = [(layer, heads[0], heads[1], a, b, new_kv_chunk((2, h, b - a, d), k0.dtype))
              for a, b in _chunk_ranges(lo, hi) for layer in range(len(pool.k))]
    # buffers from this thread's allocator (reused from the last snapshot's where it kept them);
    # the copies, and the first touch of fresh pages, on all cores; each chunk hashed piece by piece
    # as it is copied, from this core's L2 (a separate pass would read it all from memory again)
    def fill(c: tuple[int, int, int, int, int, KVChunk]) -> None:
        pool.export_into(blocks, c[0], c[3], c[4], c[5].view, hasher=(h := kv_chunk_hasher(c[5])))
        seal_kv_chunk(c[5], h)

    parallel_map(fill, chunks, nbytes)
    return chunks


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
                  tok_cap: int | None = None, defer_copy: bool = False, in_place: bool = False
                  ) -> list[SessionSnapshot]:
    """Consistent cut of sessions at this step boundary (call between two steps).

    `tok_from` skips KV a receiver already has (pre-copy rounds): only tokens from that
    index on are copied. `tok_cap` copies at most that many tokens per session, so a
    pre-copy round holds the engine thread (and every other session's decoding) only for
    a bounded copy; later rounds send the rest. `in_place` (with `defer_copy`, sessions held until
    their chunks are sent): the chunks are the pool's rows themselves (DeferredKV.in_place)."""
    snaps = []
    live = _live(engine, session_ids)
    hosts = {g: engine.executor.host_pools(g) for g in {s.dp_group for s in live}}
    if any(hosts.values()):  # the next snapshot this size reuses these buffers' memory once they are freed
        per_tok = engine.cfg.num_layers * 2 * engine.cfg.num_kv_heads * engine.cfg.head_dim * engine.dtype.itemsize
        keep_freed_memory(per_tok * sum(max(0, s.num_computed - (tok_from or {}).get(s.session_id, 0)) for s in live))
    for s in live:
        host = hosts[s.dp_group]
        lo = (tok_from or {}).get(s.session_id, 0)
        n = s.num_computed if tok_cap is None else min(s.num_computed, lo + tok_cap)
        snap = SessionSnapshot(s, n)
        table = engine.scheduler.tables.get(s.session_id)
        if n > lo and table is not None:
            blocks = table.blocks[: blocks_needed(n)]
            if host is not None and defer_copy:
                snap.deferred = DeferredKV(host, list(blocks), lo, n, engine, engine.scheduler.num_preemptions,
                                           in_place)
            elif host is not None:  # straight into chunk buffers: the one copy of this KV
                snap.chunks = [c for pool, heads in host for c in _export_chunks(pool, heads, blocks, lo, n)]
            else:
                snap.kv = engine.executor.export_kv(s.dp_group, blocks, lo, n)
        snaps.append(snap)
    return snaps


def model_ref(engine: LLMEngine) -> ModelRef:
    return ModelRef(name=engine.model_ref, fingerprint=engine.fingerprint, config=engine.cfg.to_dict())


def geometry(engine: LLMEngine) -> KVGeometry:
    """The KV this replica's pool holds: fp8 KV is stored as its fp8 values with their scales."""
    c = engine.cfg
    kv_dtype = engine.kv_dtype
    return KVGeometry(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                      dtype=dtype_name(kv_dtype), scale="token_head" if kv_dtype == FP8_KV else None)


def write_snapshot(snaps: list[SessionSnapshot], writer: CheckpointWriter, tok_from: dict[str, int] | None = None
                   ) -> None:
    """Put every session's KV chunks and state into `writer` (commit is the caller's)."""
    for _ in write_snapshot_steps(snaps, writer, tok_from):
        pass


def _nbytes(c: KVChunk | torch.Tensor) -> int:
    return c.view.nbytes if isinstance(c, KVChunk) else c.nbytes


def _put_chunks(writer: CheckpointWriter, sid: str, chunks: list[tuple]) -> None:
    def put(c: tuple, sid: str = sid) -> object:
        return writer.put_kv(sid, *c)

    if type(writer).put_kv is CheckpointWriter.put_kv:  # thread-safe: chunks hash and store in parallel
        # sealed chunks stored as they are need no hashing, only GIL-bound bookkeeping: inline is faster (11-15 vs 14-21 ms / 512 MiB)
        # (an in-place chunk was hashed where it lies: the same)
        parallel_map(put, chunks, sum(0 if writer.codec == "none" and isinstance(c[5], KVChunk) and c[5].stored
                                      else _nbytes(c[5]) for c in chunks))
    else:  # a subclass gets them in order, one at a time
        for c in chunks:
            put(c)


def write_snapshot_steps(snaps: list[SessionSnapshot], writer: CheckpointWriter,
                         tok_from: dict[str, int] | None = None) -> Iterator[None]:
    """write_snapshot, pausing (yielding) after each batch of chunks a deferred snapshot copied
    and after each session, so a caller can send what the writer's store got so far."""
    for snap in snaps:
        sid = snap.session_id
        if snap.deferred is not None:  # copied here, a chunk range at a time, then the buffers go on
            for chunks in snap.deferred.batches():
                _put_chunks(writer, sid, chunks)
                yield
        elif snap.chunks is not None:  # already cut and laid out by take_snapshot: hash and store
            _put_chunks(writer, sid, snap.chunks)
        else:
            lo0 = (tok_from or {}).get(sid, 0)
            for head_lo, head_hi, kv in snap.kv:
                # chunk boundaries at absolute multiples of CHUNK_TOKENS
                for a, b in _chunk_ranges(lo0, lo0 + kv.shape[3]):
                    for layer in range(kv.shape[0]):
                        writer.put_kv(sid, layer, head_lo, head_hi, a, b, kv[layer, :, :, a - lo0 : b - lo0])
        writer.add_session(sid, snap.state_dict, snap.num_kv_tokens, handed_over=True)
        yield


def checkpoint(engine: LLMEngine, writer: CheckpointWriter, session_ids: list[str] | None = None,
               meta: dict | None = None) -> Manifest:
    """Synchronous checkpoint for code that owns the engine thread (tests, CLI, benches)."""
    snaps = take_snapshot(engine, session_ids)
    write_snapshot(snaps, writer)
    return writer.commit(model_ref(engine), engine.layout.to_dict(), geometry(engine), meta or {})


def new_checkpoint_id() -> str:
    return f"ckpt-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"
