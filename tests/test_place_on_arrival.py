"""A live round's data path without copies it does not need (issue 29): a final round's chunks are
the source pool's own rows, hashed where they lie (storage.format.pieces), and a target writes each chunk
frame that names its entry into the blocks reserved for its session as it arrives, hash-checked
piece by piece (engine.moves.kv_stream); the round's import then skips exactly those chunks."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from relayout.engine.kv_cache import KVCache
from relayout.engine.moves.kv_stream import chunk_sink
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams
from relayout.migrate.protocol.engine_ops import EngineThreadOps
from relayout.migrate.protocol.transfers import TransferTable
from relayout.migrate.transport.frame_sink import FrameOptions
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.chunks import chunk_hash, new_kv_chunk, pack_kv
from relayout.storage.format.pieces import in_place_chunk
from relayout.storage.stores import MemoryStore
from relayout.storage.stream import MAGIC_CHUNK, StreamReceiver, chunk_frame_header, frame_head

L, H, D, BS = 2, 4, 8, 16
CPU = torch.device("cpu")


def _pool(heads: int = H, blocks: int = 12, fill: bool = False) -> KVCache:
    p = KVCache(L, blocks, heads, D, torch.float32, CPU, block_size=BS)
    if fill:
        g = torch.Generator().manual_seed(3)
        for t in p.k + p.v:
            t.copy_(torch.randn(t.shape, generator=g))
    return p


def test_an_in_place_chunk_is_byte_for_byte_the_copied_chunk():
    src, blocks = _pool(fill=True), [3, 4, 7, 8, 9]  # two runs of consecutive blocks
    views = src.row_views(blocks, 1, 5, 70)
    t = in_place_chunk((2, H, 65, D), torch.float32, views)
    assert t is not None and t.view.is_meta and t.stored
    pieces, ref = pack_kv(t, "none")
    out = new_kv_chunk((2, H, 65, D), torch.float32)
    src.export_into(blocks, 1, 5, 70, out.view)
    data, want = pack_kv(out)
    assert ref == want and bytes(pieces.joined()) == bytes(data) and chunk_hash(bytes(data)) == ref.hash
    zdata, zref = pack_kv(t, "zstd")  # another codec: the joined bytes, encoded
    assert zref.codec == "zstd" and zref.raw_size == ref.size and len(zdata) == zref.size


def _src_pools(split: tuple[int, ...]) -> list[tuple[KVCache, tuple[int, int]]]:
    """A source's pools (a TP source: one per rank, each with its share of the heads), filled."""
    out, lo = [], 0
    for k, w in enumerate(split):
        p = _pool(w, fill=True)
        for t in p.k + p.v:
            t.mul_(k + 1)  # each rank's KV its own
        out.append((p, (lo, lo + w)))
        lo += w
    return out


def _frames(srcs, blocks: list[int], n: int, chunk: int = 32, entries: bool = True) -> tuple[bytes, list]:
    """One session's KV (tokens [0, n) of every layer) as chunk frames, as a final round sends them:
    per chunk range, per source pool (its heads), per layer."""
    if isinstance(srcs, KVCache):
        srcs = [(srcs, (0, H))]
    out, refs = bytearray(), []
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        for src, (lo, hi) in srcs:
            for layer in range(L):
                pieces, ref = pack_kv(in_place_chunk((2, hi - lo, b - a, D), torch.float32,
                                                           src.row_views(blocks, layer, a, b)), "none")
                entry = {"session_id": "s", "layer": layer, "head_lo": lo, "head_hi": hi, "tok_lo": a, "tok_hi": b,
                         "kv_tokens": n, "dtype": "float32"}
                out += frame_head(MAGIC_CHUNK, chunk_frame_header(ref, entry if entries else None), ref.size)
                out += pieces.joined()
                refs.append((entry, ref))
    return bytes(out), refs


class _Engine:  # what chunk_sink reads of an engine: its config and its host pools
    def __init__(self, pools):
        self.cfg = type("cfg", (), {"num_layers": L, "num_kv_heads": H, "head_dim": D})
        self.executor = type("ex", (), {"host_pools": staticmethod(lambda g, every_copy=False: pools)})


def _reader(data: bytes, seed: int, pause_s: float = 0.0):
    """read_into over `data` in pieces of random sizes (as a socket returns them), each after `pause_s`."""
    at, rng = [0], random.Random(seed)

    def read_into(view: memoryview) -> int:
        time.sleep(pause_s)
        n = min(len(view), len(data) - at[0], rng.choice([1, 7, 100, 4096, 1 << 20]))
        view[:n] = data[at[0] : at[0] + n]
        at[0] += n
        return n

    return read_into


@pytest.mark.parametrize("src_split", [(4,), (2, 2)])  # a source of one rank, or two TP ranks
@pytest.mark.parametrize("split", [(4,), (2, 2), (1, 3)])  # a target pool holding a chunk's heads exactly
def test_chunks_naming_their_entry_go_straight_into_the_reserved_blocks_of_every_pool(src_split, split):
    # (read straight in), more of them, or some of them (through a buffer in the cache)
    srcs, src_blocks, n = _src_pools(src_split), [0, 1, 2, 5, 6], 70
    pools, lo = [], 0
    for w in split:
        pools.append((_pool(w), (lo, lo + w)))
        lo += w
    reserved, placed = {"s": (0, [9, 10, 2, 3, 4])}, {}
    data, refs = _frames(srcs, src_blocks, n)
    for seed in range(2):  # twice, into emptied pools: random piece sizes, the same result
        for pool, _ in pools:
            for t in pool.k + pool.v:
                t.zero_()
        placed.clear()
        recv = StreamReceiver(MemoryStore(), verify=False,
                              place=lambda ref, e: chunk_sink(_Engine(pools), reserved, {}, placed, ref, e))
        with pytest.raises(CorruptCheckpoint, match="before its manifest"):  # no manifest frame: not committed
            recv.receive_from(_reader(data, seed))
        assert recv.chunks_received == recv.chunks_placed == len(refs) and not recv.store.chunk_hashes()
        assert set(placed) == {(e["session_id"], e["layer"], e["head_lo"], e["head_hi"], e["tok_lo"], e["tok_hi"])
                               for e, _ in refs}
        for layer in range(L):  # [2, heads, tokens, d], the source's heads side by side
            want = torch.cat([src.export_tokens(src_blocks, 0, n)[layer] for src, _ in srcs], dim=1)
            for pool, (p_lo, p_hi) in pools:
                got = pool.export_tokens(reserved["s"][1], 0, n)[layer]
                assert torch.equal(got, want[:, p_lo:p_hi])


def test_a_placed_chunk_whose_bytes_changed_on_the_way_is_refused():
    src, blocks, n = _pool(fill=True), [0, 1, 2, 3, 4], 64
    pools = [(_pool(2), (0, 2)), (_pool(2), (2, 4))]
    data, _ = _frames(src, blocks, n)
    bad = bytearray(data)
    bad[-10] ^= 0x10  # in the last chunk's V rows
    placed: dict = {}
    recv = StreamReceiver(MemoryStore(), verify=False,
                          place=lambda ref, e: chunk_sink(_Engine(pools), {"s": (0, list(blocks))}, {}, placed, ref, e))
    with pytest.raises(CorruptCheckpoint, match="hash mismatch"):
        recv.receive_from(_reader(bytes(bad), 1))
    assert len(placed) == 2 * L - 1  # every chunk but the changed one


def test_a_receiver_that_does_not_place_chunks_takes_frames_with_entries_as_plain_chunks():
    src, blocks, n = _pool(fill=True), [0, 1, 2, 3, 4], 64
    data, refs = _frames(src, blocks, n)
    store = MemoryStore()
    recv = StreamReceiver(store)  # verifies every chunk on receipt
    recv.feed(data)
    assert sorted(store.chunk_hashes()) == sorted({r.hash for _, r in refs})


def test_chunk_sink_stages_what_it_cannot_place():
    pools = [(_pool(), (0, H))]
    eng = _Engine(pools)
    _, [(entry, ref), *_] = _frames(_pool(fill=True), [0, 1, 2, 3], 32)  # layer 0, tokens [0, 32): a real chunk
    held = {"s": (0, [0, 1])}
    assert chunk_sink(eng, held, {}, {}, ref, entry) is not None  # (the control: this one is placed)
    assert chunk_sink(eng, {}, {}, {}, ref, entry) is None  # no blocks reserved for the session (yet)
    assert chunk_sink(eng, {"s": (0, [0])}, {}, {}, ref, entry) is None  # too few blocks for its tokens
    assert chunk_sink(eng, held, {}, {}, ref, {**entry, "dtype": "bfloat16"}) is None  # converted when staged
    assert chunk_sink(eng, held, {}, {}, ref, {**entry, "layer": 9}) is None
    assert chunk_sink(eng, held, {}, {}, ref, {**entry, "layer": -1}) is None
    assert chunk_sink(eng, held, {}, {}, ref, {**entry, "tok_lo": "0"}) is None
    assert chunk_sink(eng, held, {}, {}, ref.model_copy(update={"codec": "zstd"}), entry) is None
    # rows of tokens already imported (verified in an earlier round) are never written on arrival
    assert chunk_sink(eng, held, {"s": 16}, {}, ref, entry) is None


def _tables(src: LLMEngine, dst: LLMEngine) -> tuple[TransferTable, TransferTable]:
    """The protocol's two halves in this process: the source's (rounds cut out of its pool, a final
    one in place) and the target's (placing chunks into its pools as they arrive)."""
    def call(engine: LLMEngine):
        async def run(fn):
            return fn(engine)
        return run

    dops = EngineThreadOps(call(dst))
    dops.engine = dst
    return (TransferTable(EngineThreadOps(call(src), defer_copy=True), autosweep=False),
            TransferTable(dops, autosweep=False))


def test_a_final_round_sent_in_place_and_placed_on_arrival_continues_the_session_exactly():
    """Two engines, the protocol's two halves: the source's final round (sessions held) is framed from
    its pool with entries; the target places the chunks as they arrive (its blocks reserved ahead,
    from the round's header) and the session continues with exactly the undisturbed tokens."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 40
    ref_engine = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    want = ref_engine.generate([prompt], params)[0]
    ref_engine.shutdown()
    src = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    dst = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    sid = src.add_session(prompt, params).session_id
    for _ in range(4):
        src.step()

    async def go():
        s, d = _tables(src, dst)
        frames = b"".join(bytes(f) for f in await s.export("t1", [sid], pause=True, options=FrameOptions(entries=True)))
        header = s.round_header("t1")
        assert list(header) == [sid] and header[sid] >= len(prompt)  # what the link's hello names
        res = await d.import_round("t1", _reader(frames, 5, 0.002), final=True, header=header)
        # the blocks are reserved from the header (not waited for: a chunk that comes first is staged);
        # the chunks after that go straight in
        assert res["sessions"] == [sid] and 0 < res["timing"]["placed_chunks"] <= res["timing"]["chunks"]
        await s.release([sid], "t1")
        await d.commit("t1")

    try:
        asyncio.run(go())
        done = src.sessions[sid].output_token_ids if sid in src.sessions else []
        while not dst.sessions[sid].is_finished:
            dst.step()
        st = dst.sessions[sid]
        assert st.output_token_ids == want, (done, st.output_token_ids, want)
    finally:
        for e in (src, dst):
            e.shutdown()


def test_a_placed_chunk_the_manifest_does_not_list_so_refuses_the_round():
    """A sink checks a chunk's bytes against the hash its frame names; only the manifest says what the
    round is: a placed chunk it does not list (or lists with other bytes) refuses the round."""
    from relayout.engine.moves.receive import check_placed
    from relayout.storage.checkpoint import CheckpointWriter
    from relayout.storage.format.manifest import KVGeometry, ModelRef

    w = CheckpointWriter(MemoryStore(), "r1")
    kv = torch.randn(2, H, 32, D)
    w.put_kv("s", 0, 0, H, 0, 32, kv)
    w.add_session("s", {}, 32)
    m = w.commit(ModelRef(name="m", fingerprint="f" * 16, config={}), {},
                 KVGeometry(num_layers=1, num_kv_heads=H, head_dim=D, dtype="float32"), {})
    h = m.kv_entries[0].chunk.hash
    check_placed(m, {("s", 0, 0, H, 0, 32): (h, 0, (0, 1))})  # exactly the manifest's entry: fine
    for bad in ({("s", 0, 0, H, 0, 16): (h, 0, (0,))}, {("s", 0, 0, H, 0, 32): ("1" * 32, 0, (0, 1))},
                {("t", 0, 0, H, 0, 32): (h, 0, (0, 1))}):
        with pytest.raises(CorruptCheckpoint, match="does not list"):
            check_placed(m, bad)


def test_a_transfer_dropped_while_its_round_arrives_keeps_its_blocks_until_the_round_stops():
    """An abort (or the lease) drops the transfer while its round's bytes still go into its blocks on
    the link's thread: the blocks are freed only once that round stops reading (at its next read),
    never handed to another session while a sink may still write into them."""
    import threading

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    src = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    dst = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    sid = src.add_session([5, 6, 7, 8] * 100, params).session_id
    src.step()
    gate, reached = threading.Event(), threading.Event()

    async def go():
        s, d = _tables(src, dst)
        frames = b"".join(bytes(f) for f in await s.export("t1", [sid], pause=True, options=FrameOptions(entries=True)))
        inner = _reader(frames, 2, 0.002)
        half = [0]

        def read_into(view: memoryview) -> int:
            if half[0] > len(frames) // 2 and not gate.is_set():
                reached.set()
                gate.wait(30)  # the link stalls half way, its blocks reserved and partly written
            n = inner(view)
            half[0] += n
            return n

        task = asyncio.ensure_future(d.import_round("t1", read_into, final=True, header=s.round_header("t1")))
        while not reached.is_set():
            await asyncio.sleep(0.01)
        assert dst.kv_blocks_used() > 0  # reserved ahead, from the round's header
        await d.abort("t1")
        assert "t1" not in d.incoming and dst.kv_blocks_used() > 0  # dropped, its blocks still held
        gate.set()
        with pytest.raises(Exception):  # noqa: B017 - the round stops at its next read
            await task
        assert dst.kv_blocks_used() == 0 and not dst.sessions  # freed once it stopped; nothing placed

    try:
        asyncio.run(go())
    finally:
        for e in (src, dst):
            e.shutdown()


def test_a_final_rounds_in_place_chunks_are_made_one_at_a_time_by_the_sending_thread(monkeypatch):
    """Making an in-place chunk is hashing it: the sending thread does it just before it sends that
    chunk (which then reads it from its cache), one chunk at a time, with no producer thread ahead
    of it; a pre-copy round's chunks are copies and are not marked so."""

    import relayout.engine.moves.snapshot as snapshot
    from relayout.migrate.transport.base import ROUND_WORKERS, RoundFrames

    made = [0]
    real = snapshot.in_place_chunk

    def counted(*a, **k):
        made[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(snapshot, "in_place_chunk", counted)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    src = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    dst = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    sid = src.add_session([5, 6, 7, 8] * 100, params).session_id
    src.step()
    s, _ = _tables(src, dst)

    async def export(pause: bool):
        return await s.export("t1", [sid], pause=pause, options=FrameOptions(entries=True))

    try:
        b"".join(bytes(f) for f in asyncio.run(export(False)))
        assert not s.in_place("t1") and made[0] == 0
        for _ in range(3):
            src.step()
        frames = asyncio.run(export(True))
        assert s.in_place("t1")
        out, chunks, jobs = [], 0, ROUND_WORKERS.submitted
        for f in RoundFrames(frames, inline=True).blocking():
            out.append(bytes(f))
            chunks += bytes(f[:4]) == MAGIC_CHUNK
            assert made[0] <= chunks  # no chunk is made (hashed) before the ones ahead of it are sent
        assert ROUND_WORKERS.submitted == jobs  # no producer ran ahead of the sending thread
        recv = StreamReceiver(MemoryStore())
        for f in out:
            recv.feed(f)
        m = recv.close()
        assert [e.session_id for e in m.sessions] == [sid]
        assert made[0] == chunks == len(m.kv_entries) == src.cfg.num_layers  # the 3 new tokens, every layer
    finally:
        for e in (src, dst):
            e.shutdown()


def test_a_link_round_runs_on_one_round_worker_and_its_sessions_are_reserved_once_from_its_hello(monkeypatch):
    """The target's side of a round over a real frame link (docs/protocol.md#the-path-a-byte-takes): the
    round worker that takes the connection reads every byte and writes the answer; only the manifest's
    import leaves it (for the engine thread, through the loop); the hello's header has the engine thread
    reserve blocks for all of the round's sessions in one call, before their chunks. The sessions then
    continue on the target with exactly the undisturbed tokens."""
    import threading

    import relayout.migrate.protocol.engine_ops as engine_ops
    from relayout.engine.runtime.async_engine import AsyncEngine
    from relayout.engine.web import check_id
    from relayout.migrate.transport.base import RoundCut, RoundFrames
    from relayout.migrate.transport.frame_link import FrameLinkServer, LinkAddress, TcpTransport

    params = SamplingParams(max_tokens=400, ignore_eos=True)  # (still decoding at the final round)
    prompts = [[5, 6, 7, 8] * 30, [9, 10, 11] * 50]
    ref_engine = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    want = ref_engine.generate(prompts, params)
    ref_engine.shutdown()
    src = AsyncEngine(LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20))
    dst = AsyncEngine(LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20))
    ids = [src.engine.add_session(p, params).session_id for p in prompts]
    for _ in range(3):
        src.engine.step()
    src.start()
    dst.start()
    reserved: list[tuple[str, dict]] = []  # (thread, header) of each reservation
    real_reserve = engine_ops.reserve_ahead

    def reserve(e, blocks, header):
        reserved.append((threading.current_thread().name, dict(header)))
        return real_reserve(e, blocks, header)

    monkeypatch.setattr(engine_ops, "reserve_ahead", reserve)
    s = TransferTable(EngineThreadOps.of(src, defer_copy=True), autosweep=False)
    d = TransferTable(EngineThreadOps.of(dst), autosweep=False)
    seen: dict[str, set[str]] = {"round": set(), "read": set(), "receive": set()}
    real_receive = d.ops.receive

    async def receive(i, manifest, final):
        seen["receive"].add(threading.current_thread().name)
        return await real_receive(i, manifest, final)

    d.ops.receive = receive  # type: ignore[method-assign]

    def import_round(tid, read_into, final, source, header, loop, go_on):
        seen["round"].add(threading.current_thread().name)

        def read(view):
            seen["read"].add(threading.current_thread().name)
            return read_into(view)

        return d.import_link_round(tid, read, final, source, header, loop, go_on)

    async def go():
        link = FrameLinkServer(None, import_round, lambda e: (500, str(e)), check_id, RoundCut)
        port = await link.ensure("127.0.0.1")
        t = TcpTransport(None, None, RuntimeError)
        target = "http://127.0.0.1:1"  # (never asked: its link is known)
        t.links[target] = LinkAddress("127.0.0.1", port, True, True)
        replies = []
        for final in (False, True):
            options = FrameOptions()
            frames = await s.export("t1", ids, pause=final, options=options)
            rf = RoundFrames(frames, options=options, header=s.round_header("t1"), background=not final)
            replies.append(await s.push("t1", t.push(target, "t1", rf, final=final, source=None, timeout_s=60)))
        await s.release(ids, "t1")
        await d.commit("t1")
        await link.close()
        return replies

    try:
        pre, fin = asyncio.run(go())
        assert sorted(pre["sessions"]) == sorted(ids) and sorted(fin["placed"]) == sorted(ids)
        # one worker a round (a pre-copy worker for the pre-copy round), reading on the thread it took it on
        assert len(seen["round"]) <= 2 and seen["read"] <= seen["round"]
        assert all(n.startswith(("round-io", "precopy-io")) for n in seen["round"])
        assert seen["receive"] == {threading.main_thread().name}  # the event loop: its one call to the engine
        # the pre-copy round's header reserved both sessions in one engine-thread call; the final round's
        # sessions held blocks already (nothing to reserve)
        assert [thread for thread, _ in reserved] == ["relayout-engine"]
        assert sorted(reserved[0][1]) == sorted(ids) and all(n > 0 for n in reserved[0][1].values())
        assert pre["timing"]["placed_chunks"] > 0
        for _ in range(600):
            if all(dst.engine.sessions[sid].is_finished for sid in ids):
                break
            time.sleep(0.05)
        assert [dst.engine.sessions[sid].output_token_ids for sid in ids] == want
    finally:
        for a in (src, dst):
            a.stop_sync(30)
