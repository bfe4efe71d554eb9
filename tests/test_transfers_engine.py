"""The live-migration protocol's state machine (migrate.protocol.transfers.TransferTable) driving two real
builtin:tiny engines in this process, the engine operations called directly: pre-copy round,
final round (a delta), release, commit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams, SessionStatus
from relayout.migrate.protocol.engine_ops import EngineThreadOps
from relayout.migrate.protocol.transfers import TransferTable
from relayout.storage.format.manifest import Manifest
from relayout.storage.stream import FrameDecoder


async def _pieces(frames: Iterable[bytes]) -> AsyncIterator[bytes]:
    for f in frames:
        yield f


def test_live_transfer_between_two_real_engines_continues_token_for_token():
    """Two builtin:tiny engines in this process, the real engine operations called directly:
    pre-copy round, final round, release, commit; the moved sessions finish with exactly the
    tokens of an unmigrated run."""
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 7]
    params = [SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)]
    ref = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    expected = ref.generate(prompts, params)
    src = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    dst = LLMEngine("builtin:tiny", "attn_tp=1", kv_cache_bytes=4 << 20)
    ids = [src.add_session(p, q).session_id for p, q in zip(prompts, params, strict=True)]
    for _ in range(6):
        src.step()

    def direct(engine):
        async def call(fn):
            return fn(engine)
        return call

    async def go():
        s = TransferTable(EngineThreadOps(direct(src)), autosweep=False)
        d = TransferTable(EngineThreadOps(direct(dst)), autosweep=False)
        await d.import_round("t1", _pieces(await s.export("t1", ids, max_tokens=16)), False)
        src.step()  # the source keeps decoding between rounds
        sent = dict(s.outgoing["t1"].sent_upto)
        final = list(await s.export("t1", ids, pause=True))
        # the final round is a delta: each session's KV from where the pre-copy round ended
        manifest = next(f for f in FrameDecoder().feed(b"".join(final)) if f.kind == "manifest")
        m = Manifest.parse(bytes(manifest.payload))
        assert sorted(sent) == sorted(ids) and all(sent.values())
        for i in ids:
            assert m.session(i).kv_from == sent[i] < m.session(i).num_kv_tokens
            assert all(e.tok_lo >= sent[i] for e in m.kv_entries if e.session_id == i)
        reply = await d.import_round("t1", _pieces(final), True)
        assert sorted(reply["placed"]) == sorted(ids)
        assert all(dst.sessions[i].status == SessionStatus.PAUSED for i in ids)
        await s.release(ids, "t1", "http://dst")
        assert (await d.commit("t1"))["sessions"] == reply["placed"]

    asyncio.run(go())
    assert all(src.sessions[i].status == SessionStatus.MIGRATED for i in ids) and src.kv_blocks_used() == 0
    while dst.has_work():
        dst.step()
    assert [dst.sessions[i].output_token_ids for i in ids] == expected
    for e in (ref, src, dst):
        e.shutdown()


def test_final_round_names_every_session_it_does_not_carry():
    """A session asked for that finished on the source between rounds is not in the final round,
    and the source says so (`not_moved` with its reason), so a migrator's result can list exactly
    what moved and what did not."""
    src = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    short = src.add_session([5, 6, 7] * 4, SamplingParams(max_tokens=3, ignore_eos=True)).session_id
    long = src.add_session([9, 10] * 6, SamplingParams(max_tokens=40, ignore_eos=True)).session_id

    async def call(fn):
        return fn(src)

    async def go():
        s = TransferTable(EngineThreadOps(call), autosweep=False)
        list(await s.export("t1", [short, long], max_tokens=16))
        assert s.not_moved("t1") == {}  # both still running: both in the round
        while not src.sessions[short].is_finished:
            src.step()
        final = list(await s.export("t1", [short, long], pause=True))
        m = Manifest.parse(bytes(next(f for f in FrameDecoder().feed(b"".join(final)) if f.kind == "manifest").payload))
        assert [e.session_id for e in m.sessions] == [long]
        assert s.not_moved("t1") == {short: "finished on the source before this round"}
        assert s.outgoing["t1"].paused == [long]

    asyncio.run(go())
    src.shutdown()
