"""A live round's chunks written into the target's KV pool as they arrive, not staged first.

A chunk frame that names its entry (session, layer, KV heads, tokens: storage.stream.chunk_frame_header)
and whose session already has blocks reserved by this transfer gets a `PoolRowSink`: the socket
reads its K rows, then its V rows, into a small buffer that stays in this core's cache (or, where
one pool holds all of the chunk's heads, straight into the pool's rows); each piece is hashed as it
lands and copied into every pool that holds its heads. Nothing is placed until the manifest: the
blocks are the transfer's own, and a chunk whose bytes do not hash to its reference refuses the
round (`finish`), so nothing unverified is ever served. `placed` records what went where, and the
round's import (kv_import.import_range) skips exactly those chunks.

The engine thread reserves a session's blocks from the round's header (engine.moves.receive.reserve_ahead,
once a round, not waited for); a chunk of a session no reservation holds yet is staged as before, the
chunks after the reservation are placed; the round's manifest then vouches for every chunk placed
(engine.moves.receive.check_placed).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import xxhash
from relayout.engine.kv_cache import KVCache, RowDest, write_rows
from relayout.engine.runtime.engine import LLMEngine
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.chunks import _ST_DTYPES, _st_prefix, dtype_name, stored_shape
from relayout.storage.format.manifest import ChunkRef, KVEntry

# bytes read and hashed at a time; they stay in this core's L2 (2 MiB here) for their copies. 1 MiB
# against 256 KiB: receiver 0.121-0.137 against 0.138-0.158 CPU s/GB, three pairs of
# `relayout bench datapath` runs alternating (fewer reads, each larger)
PIECE_BYTES = 1 << 20
PlacedKey = tuple[str, int, int, int, int, int]  # session, layer, head_lo, head_hi, tok_lo, tok_hi
Placed = dict[PlacedKey, tuple[str, int, tuple[int, ...]]]  # -> (chunk hash, attention-DP group, its blocks)


def placed_key(e: KVEntry) -> PlacedKey:
    return (e.session_id, e.layer, e.head_lo, e.head_hi, e.tok_lo, e.tok_hi)


def _span(blocks: list[int], tok_lo: int, tok_hi: int, block_size: int) -> tuple[int, ...]:
    """The blocks tokens [tok_lo, tok_hi) lie in."""
    return tuple(blocks[tok_lo // block_size : -(-tok_hi // block_size)])


def is_placed(placed: Placed, e: KVEntry, group: int, blocks: list[int], block_size: int) -> bool:
    """Entry `e`'s chunk, these very bytes, went into these blocks as it arrived: its import is done."""
    return placed.get(placed_key(e)) == (e.chunk.hash, group, _span(blocks, e.tok_lo, e.tok_hi, block_size))


def _entry(entry: dict[str, Any]) -> tuple[str, int, int, int, int, int, str] | None:
    try:
        out = (entry["session_id"], entry["layer"], entry["head_lo"], entry["head_hi"], entry["tok_lo"],
               entry["tok_hi"], entry["dtype"])
    except (KeyError, TypeError):
        return None
    ok = isinstance(out[0], str) and isinstance(out[6], str) and all(type(x) is int for x in out[1:6])
    return out if ok and out[1] >= 0 and 0 <= out[2] < out[3] and 0 <= out[4] < out[5] else None


def chunk_sink(engine: LLMEngine, blocks: dict[str, tuple[int, list[int]]], upto: dict[str, int], placed: Placed,
               ref: ChunkRef, entry: dict[str, Any]) -> PoolRowSink | None:
    """A sink for a chunk's payload straight into the blocks `blocks` reserves for its session (any
    thread: it reads the reservation and the pools, allocates nothing), or None: stage it. Never
    for rows of tokens already imported (below `upto`): those are verified KV a sink must not touch
    (a delta round's first chunk, which starts below them, is staged)."""
    e = _entry(entry)
    if e is None or ref.codec != "none":
        return None
    sid, layer, h_lo, h_hi, t_lo, t_hi, dtype = e
    c = engine.cfg
    held = blocks.get(sid)
    if held is None or layer >= c.num_layers or h_hi > c.num_kv_heads or t_lo < upto.get(sid, 0):
        return None
    group, blks = held
    pools = engine.executor.host_pools(group, every_copy=True)
    if not pools:
        return None
    bs = pools[0][0].block_size
    if len(blks) * bs < t_hi or any(p.quantised or dtype_name(p.k[layer].dtype) != dtype or p._pool_rows(layer) is None
                                    for p, _ in pools):
        return None
    tdtype = pools[0][0].k[layer].dtype
    shape = (2, h_hi - h_lo, t_hi - t_lo, c.head_dim)
    n = math.prod(shape) * tdtype.itemsize
    prefix = _st_prefix(stored_shape(shape), _ST_DTYPES[tdtype], n) if tdtype in _ST_DTYPES else None
    if prefix is None or ref.size != len(prefix) + n:
        return None
    key = (sid, layer, h_lo, h_hi, t_lo, t_hi)
    placed.pop(key, None)  # its rows are about to change: only a finished, hash-checked sink records them
    return PoolRowSink(pools, (h_lo, h_hi), layer, blks, t_lo, t_hi, c.head_dim, tdtype, prefix, ref,
                       lambda: placed.__setitem__(key, (ref.hash, group, _span(blks, t_lo, t_hi, bs))))


class PoolRowSink:
    """storage.stream.PayloadSink of one chunk into the pools holding its heads (see the module docstring)."""

    def __init__(self, pools: list[tuple[KVCache, tuple[int, int]]], heads: tuple[int, int], layer: int,
                 blocks: list[int], tok_lo: int, tok_hi: int, head_dim: int, dtype: torch.dtype, prefix: bytes,
                 ref: ChunkRef, on_done) -> None:
        it = dtype.itemsize
        self.row = (heads[1] - heads[0]) * head_dim * it  # bytes of one token's K (or V) in the chunk
        self.tokens, self.tok_lo, self.blocks, self.ref, self.on_done = tok_hi - tok_lo, tok_lo, blocks, ref, on_done
        self.prefix, self.head = prefix, bytearray(len(prefix))
        self.hasher = xxhash.xxh3_128()
        # per pool holding some of the chunk's heads: its K and V rows as bytes, the chunk's columns and its own
        self.dests = []
        for pool, (p_lo, p_hi) in pools:
            lo, hi = max(p_lo, heads[0]), min(p_hi, heads[1])
            if lo < hi:
                kr, vr = pool._pool_rows(layer)  # type: ignore[misc]
                self.dests.append((pool, (kr.view(np.uint8), vr.view(np.uint8)),
                                   slice((lo - heads[0]) * head_dim * it, (hi - heads[0]) * head_dim * it),
                                   slice((lo - p_lo) * head_dim * it, (hi - p_lo) * head_dim * it)))
        # one pool, the chunk's rows exactly its rows (the same heads): read straight into it
        whole = len(self.dests) == 1 and self.dests[0][2] == self.dests[0][3] == slice(0, self.row) and \
            self.dests[0][1][0].shape[1] == self.row
        self.layer = layer
        self.row_dests: list[RowDest] = [(pool, src_cols, dst_cols) for pool, _, src_cols, dst_cols in self.dests]
        self.direct = self.dests[0] if whole else None
        rows = max(1, PIECE_BYTES // self.row)
        self.bounce = None if whole else np.empty((min(rows, self.tokens), self.row), np.uint8)
        self.seg = -1  # -1: the safetensors prefix; 0: K's rows (token-major); 1: V's
        self.at = 0  # bytes of the prefix, or rows of the segment, done
        self.filled = 0  # bytes of the current piece received
        self.last: memoryview | None = None

    def want(self) -> memoryview:
        if self.seg < 0:
            return memoryview(self.head)[self.at :]
        if self.direct is not None:  # the rest of the run of consecutive blocks the next byte lies in
            pool, rows, _, _ = self.direct
            t = self.tok_lo + self.at // self.row
            _, _, slc = next(iter(pool._row_runs(self.blocks, t, self.tok_lo + self.tokens)))
            off = self.at % self.row
            self.last = memoryview(rows[self.seg][slc].reshape(-1))[off : off + PIECE_BYTES]
            return self.last
        n = min(self.bounce.shape[0], self.tokens - self.at)  # type: ignore[union-attr]
        return memoryview(self.bounce[:n].reshape(-1))[self.filled :]  # type: ignore[index]

    def got(self, n: int) -> None:
        if self.seg < 0:
            self.at += n
            if self.at == len(self.prefix):
                if bytes(self.head) != self.prefix:
                    raise CorruptCheckpoint(f"chunk {self.ref.hash}: not the KV its frame names (header differs)")
                self.hasher.update(self.head)
                self.seg, self.at = 0, 0
            return
        if self.direct is not None:  # `at` counts bytes here: hashed while they are in this core's cache
            self.hasher.update(self.last[:n])  # type: ignore[index]
            self.at += n
            if self.at == self.tokens * self.row:
                self.seg, self.at = self.seg + 1, 0
            return
        rows = min(self.bounce.shape[0], self.tokens - self.at)  # type: ignore[union-attr]
        self.filled += n
        if self.filled < rows * self.row:
            return
        piece = self.bounce[:rows]  # type: ignore[index]
        self.hasher.update(piece)
        write_rows(self.row_dests, self.blocks, self.layer, self.seg, self.tok_lo + self.at, piece)
        self.at, self.filled = self.at + rows, 0
        if self.at == self.tokens:
            self.seg, self.at = self.seg + 1, 0

    def finish(self) -> None:
        if self.seg != 2 or self.hasher.hexdigest() != self.ref.hash:
            raise CorruptCheckpoint(f"chunk {self.ref.hash}: hash mismatch (its bytes were received into the pool)")
        self.on_done()
