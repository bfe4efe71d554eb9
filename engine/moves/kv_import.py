"""The one KV write path into a replica's blocks: a checkpoint's KV of one session (restore's copy,
`import_session`) and a live round's token range from chunks received and verified (`import_range`).

Each chunk's hash is checked either way. Into a host pool, a chunk stored as is (codec "none",
token-major, the pool's dtype, all its heads) is hashed piece by piece just before each piece's
copy, so the copy reads it from L2: hashing a whole 2 MiB chunk first and then copying it reads it
from L3/memory twice (~1.4x the time of the copy alone). The blocks are the restore's own until it
places the sessions, and a mismatch raises before that, so nothing unverified is ever served.
"""

from __future__ import annotations

from functools import partial

import torch
from relayout.engine.kv_cache import KVCache, copy_into, import_hashed_rows
from relayout.engine.moves.kv_stream import is_placed
from relayout.engine.moves.snapshot import RestoreError
from relayout.engine.runtime.engine import LLMEngine
from relayout.storage.checkpoint import CheckpointReader
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.chunks import (
    check_streamed,
    kv_scaled_view,
    kv_stream_view,
    kv_view,
    parallel_map,
    verify_chunk,
)
from relayout.storage.format.manifest import Manifest
from relayout.storage.stores.base import Store

IMPORT_SLICE_TOKENS = 256  # tokens imported through a multi-rank executor at a time


def _host_layer(pool: KVCache, heads: tuple[int, int], reader: CheckpointReader, sid: str, blocks: list[int],
                layer: int) -> None:
    h_lo, h_hi = heads
    m = reader.manifest
    # chunks that can stream: unquantised on both sides, of the pool's dtype, all of its heads
    same = not pool.quantised and m.kv.scale is None and reader.dtype == pool.k[layer].dtype
    for e, data in reader.kv_stored(sid, layer, h_lo, h_hi):
        shape = e.shape(m.kv.head_dim)
        try:
            got = (kv_stream_view(data, e.chunk, shape, m.kv.dtype, m.format_version)
                   if same and (e.head_lo, e.head_hi) == (h_lo, h_hi) else None)
            if got is not None:
                pool.import_from(blocks, layer, e.tok_lo, got[0], 0, None, got[1])
                check_streamed(got[1], e.chunk)
                continue
            # any other chunk: verified whole first (and decoded, converted), as CheckpointReader reads it
            if m.kv.scale is not None:
                t, scale = kv_scaled_view(data, e.chunk, shape, m.kv.dtype)
            else:
                t, scale = kv_view(data, e.chunk, shape, m.kv.dtype, m.format_version), None
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(f"{exc} (session {sid}, layer {layer})") from None
        lo, hi = max(h_lo, e.head_lo), min(h_hi, e.head_hi)
        pool.import_from(blocks, layer, e.tok_lo, t[:, lo - e.head_lo : hi - e.head_lo], lo - h_lo,
                         None if scale is None else scale[:, lo - e.head_lo : hi - e.head_lo])


def import_session(engine: LLMEngine, reader: CheckpointReader, sid: str, group: int, blocks: list[int],
                   n_kv: int, hosts: list[tuple[KVCache, tuple[int, int]]] | None) -> None:
    """All of one session's KV from `reader` into `blocks` (freshly allocated, not yet placed).
    Every chunk is verified; `hosts` (host pools with the KV heads each holds, see Executor.host_pools)
    get each chunk copied straight into their blocks, any other executor one assembled
    [layers, 2, heads, tokens, d] tensor."""
    c = engine.cfg
    if hosts:
        # layers (of one pool) write disjoint pool tensors: one per thread
        parallel_map(lambda job: _host_layer(*job[0], reader, sid, blocks, job[1]),
                     [(h, layer) for h in hosts for layer in range(c.num_layers)])
        return
    # token-major, as the chunks, the ranks' messages and the pool are: every copy moves whole rows
    kv = torch.empty((c.num_layers, 2, n_kv, c.num_kv_heads, c.head_dim), dtype=reader.dtype)
    for layer in range(c.num_layers):
        for e, t in reader.kv_pieces(sid, layer, 0, c.num_kv_heads):
            copy_into(kv[layer, :, e.tok_lo : e.tok_hi, e.head_lo : e.head_hi], t.transpose(1, 2))
    engine.executor.import_kv(group, blocks, 0, kv.transpose(2, 3))


def _hashed_job(pools: list | None, e, data: bytes, a: int, b: int, head_dim: int, dtype: torch.dtype,
                format_version: int) -> tuple | None:
    """(pool columns, the chunk's KV view, streaming hasher) to import an unverified chunk whole while hashing
    it (kv_cache.import_hashed_rows), or None where that does not apply: a chunk of which only
    some tokens are imported, a pool holding only some of its heads, another codec or dtype."""
    if pools is None or e.tok_lo < a or e.tok_hi > b:
        return None
    cols = []
    for pool, (p_lo, p_hi) in pools:
        h0, h1 = max(p_lo, e.head_lo), min(p_hi, e.head_hi)
        if h0 >= h1:
            continue
        if (h0, h1) != (p_lo, p_hi) or pool.quantised or pool.k[e.layer].dtype != dtype:
            return None
        cols.append((pool, (h0 - e.head_lo) * head_dim, (h1 - e.head_lo) * head_dim))
    got = kv_stream_view(data, e.chunk, e.shape(head_dim), dtype, format_version) if cols else None
    if got is None:
        return None
    return (cols, got[0], got[1]) if got[0].transpose(1, 2).is_contiguous() else None


def import_range(engine: LLMEngine, store: Store, manifest: Manifest, sid: str, group: int, blocks: list[int],
                 a: int, b: int) -> None:
    """Import tokens [a, b) of one session from whichever chunks cover them. A chunk `store` holds
    verified (on receipt) is not hashed again; one held unverified (`store.unverified`, a live
    round's: migrate.protocol.received) is hashed as it is copied into the pools where it can be (its bytes
    read once), else first. A mismatch raises CorruptCheckpoint: the blocks are the transfer's,
    never placed, so nothing unverified is ever served."""
    if b <= a:
        return
    c = engine.cfg
    entries = [e for e in manifest.kv_entries if e.session_id == sid and e.tok_hi > a and e.tok_lo < b]
    covered = sum((min(b, e.tok_hi) - max(a, e.tok_lo)) * (e.head_hi - e.head_lo) for e in entries)
    if covered != c.num_layers * c.num_kv_heads * (b - a):  # before anything is fetched or written
        raise CorruptCheckpoint(f"session {sid}: chunks do not cover tokens [{a}, {b}) exactly once")
    pools = engine.executor.host_pools(group, every_copy=True)
    scaled = manifest.kv.scale is not None
    if scaled and (pools is None or len(pools) != 1):  # check_compatible refuses this before any block is reserved
        raise RestoreError("fp8 KV moves only into a replica whose KV pool is local host memory (one rank, CPU)")
    views, hashed = [], []
    placed = store.placed  # chunks already written into these blocks (engine.moves.kv_stream)
    bs = pools[0][0].block_size if pools else 0
    for e in entries:
        if bs and is_placed(placed, e, group, blocks, bs):
            continue
        data, scale = store.get_chunk(e.chunk.hash), None
        if store.unverified(e.chunk.hash):
            job = None if scaled else _hashed_job(pools, e, data, a, b, c.head_dim, engine.dtype, manifest.format_version)
            if job is not None:
                hashed.append((e, job))
                continue
            try:
                verify_chunk(data, e.chunk)
            except CorruptCheckpoint as exc:
                raise CorruptCheckpoint(f"{exc} (session {sid}, layer {e.layer})") from None
            store.mark_verified(e.chunk.hash)
        if scaled:
            t, scale = kv_scaled_view(data, e.chunk, e.shape(c.head_dim), manifest.kv.dtype, verified=True)
        else:
            t = kv_view(data, e.chunk, e.shape(c.head_dim), engine.dtype, manifest.format_version, verified=True)
        views.append((e, t, scale))
    if pools is not None:  # straight from each chunk into the blocks of every pool holding its heads
        jobs = []
        for e, t, scale in views:
            lo, hi = max(a, e.tok_lo), min(b, e.tok_hi)
            for pool, (p_lo, p_hi) in pools:
                h0, h1 = max(p_lo, e.head_lo), min(p_hi, e.head_hi)
                if h0 < h1:
                    part = t[:, h0 - e.head_lo : h1 - e.head_lo, lo - e.tok_lo : hi - e.tok_lo]
                    sc = None if scale is None else scale[:, h0 - e.head_lo : h1 - e.head_lo, lo - e.tok_lo : hi - e.tok_lo]
                    jobs.append((partial(pool.import_from, blocks, e.layer, lo, part, h0 - p_lo, sc),
                                 part.numel() * part.element_size()))

        def hash_in(e, cols: list, kv: torch.Tensor, hasher) -> None:
            import_hashed_rows(cols, blocks, e.layer, e.tok_lo, kv, hasher)
            try:
                check_streamed(hasher, e.chunk)
            except CorruptCheckpoint as exc:
                raise CorruptCheckpoint(f"{exc} (session {sid}, layer {e.layer})") from None
            store.mark_verified(e.chunk.hash)

        jobs += [(partial(hash_in, e, *job), job[1].numel() * job[1].element_size()) for e, job in hashed]
        # every job writes its own rows (a pool, a layer, a token range): on all cores, GIL released
        parallel_map(lambda j: j[0](), jobs, nbytes=sum(n for _, n in jobs))
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
