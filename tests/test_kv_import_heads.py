"""A TP rank's share of a chunk into its pool: `KVCache.import_from` of a head slice of a wider,
token-major chunk (strided rows) writes exactly what the generic torch copy writes."""

from __future__ import annotations

import pytest
import torch
from relayout.engine.kv_cache import KVCache, _strided_rows_np

L, NB, D, BS = 2, 12, 8, 16
CHUNK_HEADS = 4  # the source's heads (attn_tp=1); the target pool holds two of them
BLOCKS = [7, 2, 3, 9, 0]  # not consecutive: several runs per import


def _chunk(tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A chunk's logical [2, heads, tokens, d] view of its token-major storage [2, tokens, heads, d]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens, CHUNK_HEADS, D, generator=g).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_lo", [0, 2])
def test_head_slice_import_equals_generic_copy(dtype, head_lo):
    tok_lo, n = 5, 61  # starts and ends inside blocks
    chunk = _chunk(n, dtype, seed=head_lo)
    part = chunk[:, head_lo : head_lo + 2]  # strided rows: 2 of the chunk's 4 heads per token
    assert not part.transpose(1, 2).is_contiguous()
    assert _strided_rows_np(part.transpose(1, 2)) is not None  # the fast path applies
    fast = KVCache(L, NB, 2, D, dtype, torch.device("cpu"), block_size=BS)
    fast.import_from(BLOCKS, 1, tok_lo, part)
    # the reference: each token's K and V written at its slot with plain torch indexing
    ref = KVCache(L, NB, 2, D, dtype, torch.device("cpu"), block_size=BS)
    for i in range(n):
        pos = tok_lo + i
        blk, off = BLOCKS[pos // BS], pos % BS
        ref.k[1][blk, off] = part[0, :, i]
        ref.v[1][blk, off] = part[1, :, i]
    for x, y in zip(fast.k + fast.v, ref.k + ref.v, strict=True):
        assert torch.equal(x, y)
    out = torch.empty(2, 2, n, D, dtype=dtype)
    fast.export_into(BLOCKS, 1, tok_lo, tok_lo + n, out)
    assert torch.equal(out, part)


def test_rows_that_cannot_be_viewed_are_not_taken():
    t = torch.randn(2, 10, 4, D)[:, :, :, : D // 2]  # head_dim itself strided: not whole rows
    assert _strided_rows_np(t) is None
