"""A live round's chunks are hashed once, as the target's import copies them into the pool
(migrate.protocol.received.ReceivedChunks holds them unverified until then): a chunk whose bytes changed
on the way is refused before anything is placed; a cut round's chunks are hashed on the cut, so
its resume is told only of chunks that are whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import numpy as np
import pytest
import torch
import xxhash
from relayout.engine.kv_cache import KVCache, import_hashed_rows
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams
from relayout.migrate.protocol.engine_ops import EngineThreadOps
from relayout.migrate.protocol.transfers import TransferTable
from relayout.migrate.transport.base import RoundCut
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.chunks import chunk_hash
from relayout.storage.stream import MAGIC_CHUNK


def _direct(engine: LLMEngine):
    async def call(fn):
        return fn(engine)
    return call


async def _pieces(frames: Iterable[bytes], cut_after: int | None = None) -> AsyncIterator[bytes]:
    for k, f in enumerate(frames):
        if cut_after is not None and k == cut_after:
            raise RoundCut()  # the sender went away mid-round
        yield f


def _corrupt_chunk(frames: list, which: int = 0) -> tuple[list, str]:
    """The frames with one byte of the `which`-th chunk's payload flipped (its size unchanged), and
    that chunk's hash."""
    out, seen, bad = list(frames), -1, ""
    for k, f in enumerate(out):
        if bytes(f[:4]) == MAGIC_CHUNK:
            seen += 1
            if seen == which:
                payload = bytearray(out[k + 1])
                bad = chunk_hash(bytes(payload))
                payload[-7] ^= 0x40
                out[k + 1] = bytes(payload)
                return out, bad
    raise AssertionError("no chunk frame")


def _engines():
    src = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    dst = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    ids = [src.add_session([5, 6, 7, 8] * 30, SamplingParams(max_tokens=8, ignore_eos=True)).session_id]
    for _ in range(3):
        src.step()
    return src, dst, ids


def test_a_chunk_changed_on_the_way_is_refused_at_import_and_nothing_stays():
    src, dst, ids = _engines()

    async def go():
        s = TransferTable(EngineThreadOps(_direct(src)), autosweep=False)
        d = TransferTable(EngineThreadOps(_direct(dst)), autosweep=False)
        frames, _ = _corrupt_chunk(list(await s.export("t1", ids)), which=1)
        with pytest.raises(CorruptCheckpoint, match="hash mismatch"):
            await d.import_round("t1", _pieces(frames), False)
        assert "t1" not in d.incoming  # the transfer is dropped: nothing reserved, nothing placed
        # a clean round of another transfer then moves the session, every chunk hashed by its import
        await s.abort("t1")  # (the migrator's abort, on the source)
        ok = list(await s.export("t2", ids))
        await d.import_round("t2", _pieces(ok), False)
        held = d.incoming["t2"].store
        assert not any(held.unverified(h) for h in held.chunk_hashes())

    try:
        asyncio.run(go())
        assert dst.kv_blocks_used() > 0 and not dst.sessions  # reserved for t2, not placed
    finally:
        for e in (src, dst):
            e.shutdown()


def test_a_cut_rounds_chunks_are_hashed_on_the_cut_and_a_changed_one_is_not_acknowledged():
    src, dst, ids = _engines()

    async def go():
        s = TransferTable(EngineThreadOps(_direct(src)), autosweep=False)
        d = TransferTable(EngineThreadOps(_direct(dst)), autosweep=False)
        frames = list(await s.export("t1", ids))
        n_chunks = sum(bytes(f[:4]) == MAGIC_CHUNK for f in frames)
        assert n_chunks >= 2
        frames, bad = _corrupt_chunk(frames, which=0)
        with pytest.raises(RoundCut):
            await d.import_round("t1", _pieces(frames, cut_after=len(frames) - 1), False)  # all but the manifest
        acked = d.state("t1")["chunks"]  # what a resumed round is told the target holds
        assert len(acked) == n_chunks - 1 and bad not in acked
        store = d.incoming["t1"].store
        assert not any(store.unverified(h) for h in acked)

    try:
        asyncio.run(go())
    finally:
        for e in (src, dst):
            e.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hashed_import_into_two_tp_pools_equals_plain_import_and_hashes_the_chunk(dtype):
    """One chunk of 4 heads into two pools of 2 heads each (a TP2 target), hashed as copied."""
    d, n, tok_lo, blocks = 8, 40, 16, [5, 1, 2, 7]
    stored = torch.randn(2, n, 4, d).to(dtype)  # the chunk's storage: token-major
    kv = stored.transpose(1, 2)  # its logical [2, heads, tokens, d] view
    pools = [KVCache(1, 8, 2, d, dtype, torch.device("cpu"), block_size=16) for _ in range(2)]
    h = xxhash.xxh3_128()
    import_hashed_rows([(pools[0], 0, 2 * d), (pools[1], 2 * d, 4 * d)], blocks, 0, tok_lo, kv, h)
    assert h.hexdigest() == xxhash.xxh3_128(stored.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                                            .numpy().tobytes()).hexdigest()
    for i, pool in enumerate(pools):
        ref = KVCache(1, 8, 2, d, dtype, torch.device("cpu"), block_size=16)
        ref.import_from(blocks, 0, tok_lo, kv[:, 2 * i : 2 * i + 2].contiguous())
        assert torch.equal(pool.k[0], ref.k[0]) and torch.equal(pool.v[0], ref.v[0])
        assert np.any(pool.k[0].float().numpy() != 0)
