"""A checkpoint's KV of one session into freshly allocated blocks of a replica (restore's copy).

Each chunk's hash is checked either way. Into a host pool, a chunk stored as is (codec "none",
token-major, the pool's dtype, all its heads) is hashed piece by piece just before each piece's
copy, so the copy reads it from L2: hashing a whole 2 MiB chunk first and then copying it reads it
from L3/memory twice (~1.4x the time of the copy alone). The blocks are the restore's own until it
places the sessions, and a mismatch raises before that, so nothing unverified is ever served.
"""

from __future__ import annotations

import torch
from relayout.engine.engine import LLMEngine
from relayout.engine.kv_cache import KVCache, copy_into
from relayout.storage.checkpoint import CheckpointReader
from relayout.storage.chunks import check_streamed, kv_scaled_view, kv_stream_view, kv_view, parallel_map
from relayout.storage.errors import CorruptCheckpoint


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
    Every chunk is verified; `hosts` (host pools with the KV heads each holds, see snapshot.host_pool)
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
