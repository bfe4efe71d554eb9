"""Paged KV cache: fixed-size blocks, a block table per session, a free list.

The driver owns the bookkeeping (`BlockAllocator`, `KVBlockTable`); each rank owns the
tensors (`KVCache`) for its attention data-parallel group and its slice of KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

BLOCK_SIZE = 16
# bytes copied then hashed at a time by a hashing export: small enough that the copy's source and
# destination stay in one core's L2 (1 MiB here) until the hash reads them; 256 KiB measured best
HASH_PIECE = 256 << 10
FP8_KV = torch.float8_e4m3fn  # the element type of an fp8_e4m3 KV pool
FP8_MAX = float(torch.finfo(FP8_KV).max)  # 448
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; host to host of one dtype goes through numpy: one thread, no OpenMP team
    per call (whose wake-ups dominate chunk-sized copies on a busy machine) and the GIL released,
    so several chunks copy at once from parallel_map."""
    it = _SAME_SIZE_INT.get(dst.element_size())
    if (dst.dtype != src.dtype or it is None or dst.device.type != "cpu" or src.device.type != "cpu"
            or dst.shape != src.shape or dst.numel() == 0 or dst.stride(-1) != 1 or src.stride(-1) != 1):
        dst.copy_(src)
        return
    try:
        d, s = dst.view(it).numpy(), src.view(it).numpy()
    except (RuntimeError, TypeError):  # a tensor numpy cannot see (autograd, conj views...)
        dst.copy_(src)
        return
    np.copyto(d, s)  # bit copy: the same dtype on both sides


def _rows_np(t: torch.Tensor, width: int) -> np.ndarray | None:
    """`t` (CPU, contiguous, 1/2/4/8-byte elements) as a numpy [rows, width] array of same-size ints
    sharing its memory, else None. Slicing numpy views costs ~1 us where a torch view and its
    copy_into checks cost ~20 us: at a few hundred run copies per snapshot that is ~10% of it."""
    it = _SAME_SIZE_INT.get(t.element_size())
    if it is None or t.device.type != "cpu" or not t.is_contiguous() or t.numel() % width:
        return None
    try:
        return t.view(it).numpy().reshape(-1, width)
    except (RuntimeError, TypeError):  # a tensor numpy cannot see (autograd, conj views...)
        return None


def _strided_rows_np(t: torch.Tensor) -> np.ndarray | None:
    """`t` ([2, tokens, heads, head_dim] on the CPU, each token's heads x head_dim contiguous, e.g.
    a head slice of a wider chunk) as a numpy [2, tokens, heads * head_dim] view of same-size ints
    sharing its memory (rows strided), else None. Lets a TP rank's share of a chunk go into its pool
    as one numpy copy per run of blocks instead of a torch copy per run."""
    it = _SAME_SIZE_INT.get(t.element_size())
    if it is None or t.device.type != "cpu" or t.dim() != 4 or t.stride(3) != 1 or t.stride(2) != t.shape[3]:
        return None
    try:
        a = t.view(it).numpy()
    except (RuntimeError, TypeError):
        return None
    v = a.view()
    try:
        v.shape = (t.shape[0], t.shape[1], t.shape[2] * t.shape[3])  # raises where that would copy
    except AttributeError:
        return None
    return v


# a pool, the columns of a source row it takes (None: all), and its own columns they go to (None: all)
RowDest = tuple["KVCache", "slice | None", "slice | None"]


def write_rows(dests: list[RowDest], blocks: list[int], layer: int, j: int, tok_lo: int, src: np.ndarray,
               hasher: Hasher | None = None, piece_rows: int | None = None) -> None:
    """The one way a move writes KV into pools: `src` ([tokens, row] of K (j=0) or V (j=1), token-major,
    as a chunk stores them and a pool holds them) into the rows of tokens from `tok_lo` of `blocks`,
    in every pool of `dests` (pools of one attention-DP group share their blocks, so one set of runs
    serves them all), a run of consecutive blocks per copy. `hasher`: fed each piece of `piece_rows`
    rows just before its copies, which then read it from L2 (the chunk is read from memory once,
    for the hash and the copies together). Byte rows (uint8) go into the pools' rows as bytes."""
    n = src.shape[0]
    if n == 0:
        return
    rows = []
    for pool, src_cols, dst_cols in dests:
        pr = pool._pool_rows(layer)
        if pr is None:
            raise ValueError("write_rows needs pools numpy can view")
        d = pr[j] if pr[j].dtype == src.dtype else pr[j].view(src.dtype)
        rows.append((d, src_cols, dst_cols))
    step = piece_rows or n
    for a, b, sl in dests[0][0]._row_runs(blocks, tok_lo, tok_lo + n):
        run = src[a - tok_lo : b - tok_lo]
        for i in range(0, b - a, step):
            piece = run[i : i + step]
            if hasher is not None:
                hasher.update(piece)
            rws = slice(sl.start + i, min(sl.stop, sl.start + i + step))
            for d, src_cols, dst_cols in rows:
                np.copyto(d[rws] if dst_cols is None else d[rws, dst_cols],
                          piece if src_cols is None else piece[:, src_cols])


def import_hashed_rows(pools: list[tuple[KVCache, int, int]], blocks: list[int], layer: int, tok_lo: int,
                       kv: torch.Tensor, hasher: Hasher) -> None:
    """A chunk's K and V (`kv`: [2, heads, tokens, head_dim], all the chunk's heads, a view of its
    token-major storage) into every pool that holds some of its heads (`pools`: each with its
    columns [c0, c1) of a row), tokens from `tok_lo` of `blocks`, and into `hasher` in memory
    order (write_rows: each piece hashed just before its copies)."""
    n, width = kv.shape[2], kv.shape[1] * kv.shape[3]
    flat = _rows_np(kv.transpose(1, 2), width)
    if flat is None:
        raise ValueError("import_hashed_rows needs a token-major chunk numpy can view")
    src = flat.reshape(2, n, width)
    step = max(1, HASH_PIECE // (src.shape[2] * src.itemsize))  # rows per hashed piece
    dests: list[RowDest] = [(p, slice(c0, c1), None) for p, c0, c1 in pools]
    for j in (0, 1):  # all of K, then all of V: the chunk's memory order, as the hash reads it
        write_rows(dests, blocks, layer, j, tok_lo, src[j], hasher, step)


def kv_storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for a KV dtype name ("auto": the model's)."""
    if kv_dtype == "auto":
        return model_dtype
    if kv_dtype == "fp8_e4m3":
        return FP8_KV
    raise ValueError(f"unknown KV dtype {kv_dtype!r}; allowed: auto, fp8_e4m3")


def quantise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, heads, d] -> (float8 values, float32 scale per token and head), x ~ values * scale."""
    xf = x.float()
    scale = xf.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (xf / scale.unsqueeze(-1)).to(FP8_KV), scale


class Hasher(Protocol):
    """A streaming hash (xxhash.xxh3_128): what export_into feeds the bytes it copies."""

    def update(self, data: np.ndarray) -> None: ...


class OutOfBlocks(RuntimeError):
    pass


@dataclass
class KVBlockTable:
    """Blocks holding one session's KV, in token order."""

    blocks: list[int] = field(default_factory=list)

    def num_slots(self, block_size: int = BLOCK_SIZE) -> int:
        return len(self.blocks) * block_size

    def slot(self, pos: int, block_size: int = BLOCK_SIZE) -> int:
        return self.blocks[pos // block_size] * block_size + pos % block_size


class BlockAllocator:
    """Free list of one KV pool (one per attention data-parallel group)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # pop() from the end hands out low block ids first, which keeps tests readable
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.reserved = 0  # blocks promised to incoming sessions (migration targets)

    @property
    def num_free(self) -> int:
        return len(self._free) - self.reserved

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int, from_reserved: bool = False) -> list[int]:
        avail = len(self._free) if from_reserved else self.num_free
        if n > avail:
            raise OutOfBlocks(f"need {n} KV blocks, {max(avail, 0)} free")
        if from_reserved:
            self.reserved = max(0, self.reserved - n)
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def reserve(self, n: int) -> None:
        if n > self.num_free:
            raise OutOfBlocks(f"cannot reserve {n} KV blocks, {self.num_free} free")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        self.reserved = max(0, self.reserved - n)


def blocks_needed(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return (num_tokens + block_size - 1) // block_size


class KVCache:
    """One rank's KV tensors: per layer [num_blocks, block_size, local_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, block_size: int = BLOCK_SIZE,
                 compute_dtype: torch.dtype | None = None,
                 tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None):
        self.block_size = block_size
        self.compute_dtype = compute_dtype or dtype  # what attention reads
        shape = (num_blocks, block_size, kv_heads, head_dim)
        # `tensors`: K and V per layer already allocated (zeroed), e.g. in shared memory (engine.ranks.shared_kv)
        self.k = tensors[0] if tensors else [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = tensors[1] if tensors else [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # float8 pools: a float32 scale per token per KV head beside them (value = fp8 * scale). Per token
        # rather than per block, so a block's earlier tokens never need requantising as it fills (bytes
        # a pre-copy round already sent stay valid) and no later token is clipped to an earlier scale.
        self.quantised = dtype == FP8_KV
        self.k_scale = [torch.zeros(shape[:3], device=device) for _ in range(num_layers)] if self.quantised else []
        self.v_scale = [torch.zeros(shape[:3], device=device) for _ in range(num_layers)] if self.quantised else []
        # reused gather buffers: allocating a fresh multi-MB tensor per layer per step costs
        # more (page faults) than the copy itself
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: list[tuple[np.ndarray, np.ndarray] | None] | None = None  # see _pool_rows

    def _pool_rows(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """K and V of `layer` as numpy [slots, heads * head_dim] views (made once: the pool's tensors
        live as long as it does), or None where numpy cannot view them."""
        rows = self._rows
        if rows is None:  # built whole, then published: layers import on several threads at once
            rows = []
            for k, v in zip(self.k, self.v, strict=True):
                w = k.shape[2] * k.shape[3]
                kr, vr = _rows_np(k, w), _rows_np(v, w)
                rows.append(None if kr is None or vr is None else (kr, vr))
            self._rows = rows
        return rows[layer]

    def _grow_scratch(self, n: int) -> None:
        cap = max(n, 2 * (self._scratch[0].shape[0] if self._scratch else 0), 16)
        k_pool, v_pool = self.k[0], self.v[0]
        with torch.inference_mode(False):  # a normal tensor: usable by forward and by exports alike
            self._scratch = (k_pool.new_empty((cap, *k_pool.shape[1:])), v_pool.new_empty((cap, *v_pool.shape[1:])))

    def reserve_scratch(self, n: int) -> None:
        """Room for a step over `n` blocks in the gather buffers, their pages touched now: a session
        moving in at a long context would otherwise pay for both in its first step here (its stall)."""
        if self.quantised or (self._scratch is not None and self._scratch[0].shape[0] >= n):
            return
        self._grow_scratch(n)
        assert self._scratch is not None
        for t in self._scratch:
            t.zero_()

    def gather_blocks(self, layer: int, flat_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the given blocks, [n_blocks, block_size, kv_heads, head_dim], in reused buffers
        (valid until the next call)."""
        n = flat_blocks.numel()
        k_pool, v_pool = self.k[layer], self.v[layer]
        if self.quantised:  # dequantised into fresh tensors of the compute dtype
            return tuple(  # type: ignore[return-value]
                (torch.index_select(pool, 0, flat_blocks).float()
                 * torch.index_select(scale, 0, flat_blocks).unsqueeze(-1)).to(self.compute_dtype)
                for pool, scale in ((k_pool, self.k_scale[layer]), (v_pool, self.v_scale[layer])))
        if self._scratch is None or self._scratch[0].shape[0] < n:
            self._grow_scratch(n)
        assert self._scratch is not None
        kb, vb = self._scratch[0][:n], self._scratch[1][:n]
        torch.index_select(k_pool, 0, flat_blocks, out=kb)
        torch.index_select(v_pool, 0, flat_blocks, out=vb)
        return kb, vb

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kf = self.k[layer].view(-1, *self.k[layer].shape[2:])
        vf = self.v[layer].view(-1, *self.v[layer].shape[2:])
        if self.quantised:
            for pool, scales, x in ((kf, self.k_scale[layer], k), (vf, self.v_scale[layer], v)):
                q, scale = quantise_fp8(x)
                pool.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))  # no float8 kernel on CPU
                scales.view(-1, scales.shape[2]).index_copy_(0, slots, scale)
            return
        kf.index_copy_(0, slots, k)
        vf.index_copy_(0, slots, v)

    def refuse_quantised(self) -> None:
        if self.quantised:
            raise ValueError("checkpoints and migrations of fp8_e4m3 KV are not supported yet: the format does "
                             "not carry the KV scales (serve with kv_dtype auto to move sessions)")

    def gather(self, layer: int, blocks: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one session: [num_tokens, kv_heads, head_dim]."""
        nb = (num_tokens + self.block_size - 1) // self.block_size
        kb, vb = self.gather_blocks(layer, blocks[:nb])
        return kb.flatten(0, 1)[:num_tokens], vb.flatten(0, 1)[:num_tokens]

    def export_tokens(self, blocks: list[int], tok_lo: int, tok_hi: int) -> torch.Tensor:
        """KV of tokens [tok_lo, tok_hi) for every layer: [layers, 2, kv_heads, tokens, head_dim], a
        view of token-major memory ([layers, 2, tokens, kv_heads, head_dim], the pool's and the
        chunks' order: `.transpose(2, 3)` of the result is contiguous).

        One copy per layer and K/V into the result (a second, into a reused buffer, only when
        the blocks are not consecutive in the pool)."""
        self.refuse_quantised()
        bs = self.block_size
        b0, b1 = tok_lo // bs, (tok_hi + bs - 1) // bs
        ids = blocks[b0:b1]
        off, n = tok_lo - b0 * bs, tok_hi - tok_lo
        k0 = self.k[0]
        out = torch.empty((len(self.k), 2, n, k0.shape[2], k0.shape[3]), dtype=k0.dtype, device=k0.device)
        consecutive = all(b == ids[0] + i for i, b in enumerate(ids))
        idx = None if consecutive else torch.tensor(ids, dtype=torch.long, device=k0.device)
        for layer in range(len(self.k)):
            if consecutive:
                kk, vv = self.k[layer][ids[0] : ids[0] + len(ids)], self.v[layer][ids[0] : ids[0] + len(ids)]
            else:
                kk, vv = self.gather_blocks(layer, idx)
            copy_into(out[layer, 0], kk.flatten(0, 1)[off : off + n])
            copy_into(out[layer, 1], vv.flatten(0, 1)[off : off + n])
        return out.transpose(2, 3)

    def _runs(self, blocks: list[int], tok_lo: int, tok_hi: int):
        """Tokens [tok_lo, tok_hi) as runs in consecutive pool blocks: (a, b, first_block, offset) for
        tokens [a, b), which are rows offset.. of the flattened blocks from first_block on."""
        bs = self.block_size
        i, last = tok_lo // bs, (tok_hi - 1) // bs
        while i <= last:
            j = i
            while j < last and blocks[j + 1] == blocks[j] + 1:
                j += 1
            a, b = max(tok_lo, i * bs), min(tok_hi, (j + 1) * bs)
            yield a, b, blocks[i], a - i * bs
            i = j + 1

    def export_into(self, blocks: list[int], layer: int, tok_lo: int, tok_hi: int, out: torch.Tensor,
                    scale_out: torch.Tensor | None = None, hasher: Hasher | None = None) -> None:
        """K, V of one layer, tokens [tok_lo, tok_hi), into `out` ([2, kv_heads, tokens, head_dim], any
        device/dtype): straight from the pool, one copy per run of consecutive blocks and K/V, no
        staging. A token-major `out` (a chunk, see storage.format.chunks.new_kv_chunk) makes each of those
        one contiguous memcpy, the pool's rows being [tokens, heads, head_dim] too. A quantised pool
        also needs `scale_out` ([2, kv_heads, tokens], float32): the values are copied as stored.
        `hasher` (a CPU, token-major `out`): fed all of `out`'s bytes in memory order, each piece of
        at most HASH_PIECE bytes right after its copy, while it is in this core's L2."""
        if self.quantised and scale_out is None:
            self.refuse_quantised()
        if tok_hi <= tok_lo:
            return
        dst = out.transpose(1, 2)  # [2, tokens, heads, head_dim]: the pool's order
        sdst = scale_out.transpose(1, 2) if self.quantised and scale_out is not None else None
        pool_rows = self._pool_rows(layer) if out.dtype == self.k[layer].dtype else None
        dst_rows = _rows_np(dst, dst.shape[2] * dst.shape[3]) if pool_rows is not None else None
        if hasher is not None and (dst_rows is None or sdst is not None):
            raise ValueError("export_into hashes only a CPU token-major out of the pool's dtype, without scales")
        if dst_rows is not None and pool_rows is not None and sdst is None:  # one numpy copy per run, GIL released
            d = dst_rows.reshape(2, tok_hi - tok_lo, -1)
            runs = list(self._row_runs(blocks, tok_lo, tok_hi))
            step = max(1, HASH_PIECE // (d.shape[2] * d.itemsize))  # rows per hashed piece
            for j in (0, 1):  # all of K, then all of V: the chunk's memory order, as the hash reads it
                for a, b, rows in runs:
                    dj, sj = d[j, a - tok_lo : b - tok_lo], pool_rows[j][rows]
                    if hasher is None:
                        np.copyto(dj, sj)
                        continue
                    for i in range(0, b - a, step):
                        np.copyto(dj[i : i + step], sj[i : i + step])
                        hasher.update(dj[i : i + step])
            return
        for a, b, rows in self._row_runs(blocks, tok_lo, tok_hi):
            for j, pool in enumerate((self.k[layer], self.v[layer])):
                copy_into(dst[j, a - tok_lo : b - tok_lo], pool.view(-1, *pool.shape[2:])[rows])
            if sdst is not None:
                for j, sc in enumerate((self.k_scale[layer], self.v_scale[layer])):
                    copy_into(sdst[j, a - tok_lo : b - tok_lo], sc.view(-1, sc.shape[2])[rows])

    def row_views(self, blocks: list[int], layer: int, tok_lo: int, tok_hi: int) -> list[memoryview] | None:
        """K, V of one layer, tokens [tok_lo, tok_hi), as views of the pool's own rows in a chunk's
        stored order (K's runs of consecutive blocks, then V's): no copy. None where numpy cannot
        view the pool (another device, fp8 with scales)."""
        rows = None if self.quantised else self._pool_rows(layer)
        if rows is None:
            return None
        runs = [r for _, _, r in self._row_runs(blocks, tok_lo, tok_hi)]
        return [memoryview(rows[j][r]) for j in (0, 1) for r in runs]

    def import_from(self, blocks: list[int], layer: int, tok_lo: int, kv: torch.Tensor, head_lo: int = 0,
                    scale: torch.Tensor | None = None, hasher: Hasher | None = None) -> None:
        """Inverse of export_into for local heads [head_lo, head_lo + kv.shape[1]): kv is
        [2, heads, tokens, head_dim] for tokens from tok_lo, with its float32 `scale` ([2, heads, tokens])
        when it is quantised. Any dtype goes into any pool: copied as is when they match, else cast,
        dequantised (fp8 into a plain pool) or quantised (into an fp8 pool). `hasher` (kv token-major,
        of the pool's dtype, all its heads, no scales): fed all of kv's bytes in memory order, each
        piece of at most HASH_PIECE bytes just before its copy (which then reads it from L2)."""
        if hasher is not None and (self.quantised or scale is not None or kv.dtype != self.k[layer].dtype):
            raise ValueError("import_from hashes only whole-row KV of the pool's dtype, without scales")
        if self.quantised and (scale is None or kv.dtype != self.k[layer].dtype):
            x = kv.float() if scale is None else kv.float() * scale.unsqueeze(-1)
            kv, scale = quantise_fp8(x)  # per token and head, as write() does
        elif not self.quantised and scale is not None:
            kv, scale = kv.float() * scale.unsqueeze(-1), None
        n, h = kv.shape[2], kv.shape[1]
        if n == 0:
            return
        if not 0 <= head_lo <= head_lo + h <= self.k[layer].shape[2]:
            raise ValueError(f"heads [{head_lo},{head_lo + h}) outside this cache's {self.k[layer].shape[2]}")
        src = kv.transpose(1, 2)  # [2, tokens, heads, head_dim]: a chunk's stored order
        ssrc = scale.transpose(1, 2) if self.quantised and scale is not None else None
        full = h == self.k[layer].shape[2]  # all of the pool's heads: whole pool rows
        pool_rows = self._pool_rows(layer) if full and ssrc is None and kv.dtype == self.k[layer].dtype else None
        if pool_rows is not None and hasher is None:
            # whole rows, or a head slice of a wider chunk (a TP rank's share: rows strided): one numpy
            # copy per run of blocks, GIL released
            strided = _strided_rows_np(src)
            if strided is not None:
                for j in (0, 1):
                    write_rows([(self, None, None)], blocks, layer, j, tok_lo, strided[j])
                return
        src_rows = _rows_np(src, h * kv.shape[3]) if pool_rows is not None and hasher is not None else None
        if hasher is not None and src_rows is None:
            raise ValueError("import_from hashes only whole-row, token-major KV of all the pool's heads")
        if src_rows is not None and pool_rows is not None and hasher is not None:
            s = src_rows.reshape(2, n, -1)
            step = max(1, HASH_PIECE // (s.shape[2] * s.itemsize))  # rows per hashed piece
            for j in (0, 1):  # all of K, then all of V: the chunk's memory order, as the hash reads it
                write_rows([(self, None, None)], blocks, layer, j, tok_lo, s[j], hasher, step)
            return
        for a, b, rows in self._row_runs(blocks, tok_lo, tok_lo + n):
            for j, pool in enumerate((self.k[layer], self.v[layer])):
                copy_into(pool.view(-1, *pool.shape[2:])[rows, head_lo : head_lo + h], src[j, a - tok_lo : b - tok_lo])
            if ssrc is not None:
                for j, sc in enumerate((self.k_scale[layer], self.v_scale[layer])):
                    copy_into(sc.view(-1, sc.shape[2])[rows, head_lo : head_lo + h], ssrc[j, a - tok_lo : b - tok_lo])

    def import_tokens(self, blocks: list[int], tok_lo: int, kv: torch.Tensor) -> None:
        """Inverse of export_tokens; kv: [layers, 2, kv_heads, tokens, head_dim]. Through write(), slot by
        slot, as a step writes: the reference the moves' row copies (write_rows) are checked against."""
        self.refuse_quantised()
        bs = self.block_size
        n = kv.shape[3]
        pos = torch.arange(tok_lo, tok_lo + n)
        blk = torch.tensor(blocks, dtype=torch.long)[pos // bs]
        slots = (blk * bs + pos % bs).to(self.k[0].device)
        for layer in range(len(self.k)):
            t = kv[layer].to(self.k[layer].device, self.k[layer].dtype)
            self.write(layer, slots, t[0].transpose(0, 1), t[1].transpose(0, 1))

    def _row_runs(self, blocks: list[int], tok_lo: int, tok_hi: int):
        """_runs as (a, b, slice of the flattened pool's rows holding tokens [a, b))."""
        for a, b, blk, off in self._runs(blocks, tok_lo, tok_hi):
            start = blk * self.block_size + off
            yield a, b, slice(start, start + b - a)
