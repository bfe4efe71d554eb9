"""The live-migration protocol's state machine (migrate.protocol.transfers.TransferTable), in one process
with a fake clock: leases, the two-phase commit, aborts in every phase, the sweeper's verdicts
on transfers left in doubt. Frames are real (a source table's export feeds a target table's
import); the engine is a recording fake (a real builtin:tiny LLMEngine: test_transfers_engine.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import pytest
import torch
from relayout.engine.moves.snapshot import SessionSnapshot
from relayout.engine.runtime.session import SamplingParams, SessionState
from relayout.migrate.protocol.transfers import (
    ImportTooLarge,
    Incoming,
    RoundCut,
    SourceRound,
    TooManyTransfers,
    TransferConflict,
    TransferTable,
    UnknownSession,
    UnknownTransfer,
)
from relayout.migrate.transport.frame_sink import FrameSink
from relayout.storage.checkpoint import CheckpointWriter
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.manifest import KVGeometry, ModelRef
from relayout.storage.stores import MemoryStore
from relayout.storage.stream import FrameDecoder, StreamReceiver

TTL = 10.0
GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=2, head_dim=16, dtype="float32")
MODEL = ModelRef(name="m", fingerprint="f" * 16, config={})


class Clock:
    now = 100.0  # each test's clock sets its own

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Records what the protocol asked of the engine; sessions s1, s2 live here (16 KV tokens each)."""

    def __init__(self, sessions: Iterable[str] = ("s1", "s2")) -> None:
        self.live = list(sessions)
        self.paused: set[str] = set()
        self.released: list[str] = []
        self.placed: dict[str, list[str]] = {}  # transfer -> sessions placed (paused) here
        self.running: list[str] = []  # committed sessions
        self.aborted: list[str] = []

    def placer(self, t: Incoming, header, loop):
        return None  # no pool: a link round's chunks are staged and imported whole

    async def take_round(self, sessions, pause, sent, max_tokens) -> SourceRound:
        ids = list(self.live if sessions is None else sessions)
        for sid in ids:
            if sid not in self.live:
                raise KeyError(f"session {sid} is not on this replica")
        if pause:
            self.paused.update(ids)
        snaps = []
        for i, sid in enumerate(ids):
            lo = sent.get(sid, 0)
            kv = torch.full((1, 2, 2, 16 - lo, 16), float(i + 1)) if lo < 16 else None
            snaps.append(SessionSnapshot(SessionState(sid, [1, 2, 3] * 6, SamplingParams()), 16,
                                         [(0, 2, kv)] if kv is not None else None))
        return SourceRound(ids if pause else [], snaps, MODEL, {"attn_dp": 1}, GEOMETRY)

    async def resume(self, session_ids):
        self.paused.difference_update(session_ids)

    async def release(self, session_ids, migrated_to):
        self.released += session_ids
        self.live = [s for s in self.live if s not in session_ids]

    async def receive(self, t: Incoming, manifest, final):
        for e in manifest.sessions:
            t.blocks.setdefault(e.session_id, (0, [1]))
            t.upto[e.session_id] = e.num_kv_tokens
        if final:
            t.placed = sorted(t.blocks)
            t.blocks.clear()
            self.placed[t.transfer_id] = list(t.placed)
        return {"sessions": sorted(e.session_id for e in manifest.sessions), "imported_tokens": 0}

    async def commit(self, t: Incoming):
        self.running += t.placed
        return list(t.placed)

    async def abort(self, t: Incoming):
        self.aborted.append(t.transfer_id)


class Pair:
    """A source and a target table sharing one fake clock (the wire between them is in memory)."""

    def __init__(self, ask_answer=None, **kw) -> None:
        self.clock = Clock()
        self.src_engine, self.dst_engine = FakeEngine(), FakeEngine(())
        self.asked: list[tuple[str, str]] = []
        self.ask_answer = ask_answer

        async def ask(source: str, tid: str):
            self.asked.append((source, tid))
            if isinstance(self.ask_answer, Exception):
                raise self.ask_answer
            return self.ask_answer

        self.src = TransferTable(self.src_engine, clock=self.clock, ttl=lambda: TTL, autosweep=False)
        self.dst = TransferTable(self.dst_engine, ask, clock=self.clock, ttl=lambda: TTL, autosweep=False, **kw)

    async def round(self, tid: str, final: bool = False, source: str | None = "http://src:1", **kw) -> dict:
        frames = await self.src.export(tid, None, pause=final, **kw)
        return await self.dst.import_round(tid, _pieces(frames), final, source)

    async def prepared(self, tid: str = "t1", source: str | None = "http://src:1") -> None:
        """Pre-copy round, then the final round: the target holds the sessions placed."""
        await self.round(tid, source=source)
        reply = await self.round(tid, final=True, source=source)
        assert reply["placed"] == ["s1", "s2"]


async def _pieces(frames: Iterable[bytes]) -> AsyncIterator[bytes]:
    for f in frames:
        yield f


def run(coro):
    return asyncio.run(coro)


# ---- source: the lease ------------------------------------------------------------------------------
def test_outgoing_lease_expiry_resumes_paused_and_refuses_late_release():
    async def go():
        p = Pair()
        await p.prepared()
        assert p.src.state("t1")["outgoing"] == "paused" and p.src_engine.paused == {"s1", "s2"}
        p.clock.now += TTL - 1
        await p.src.sweep()
        assert p.src.state("t1")["outgoing"] == "paused"  # not yet
        p.clock.now += 2
        await p.src.sweep()
        assert p.src.state("t1")["outgoing"] == "expired" and p.src_engine.paused == set()
        with pytest.raises(TransferConflict, match="expired.*the sessions stay here"):
            await p.src.release(["s1", "s2"], "t1")
        assert p.src_engine.released == []
        with pytest.raises(TransferConflict, match="already ended"):
            await p.src.export("t1", None)

    run(go())


def test_release_is_the_commit_and_ends_the_lease():
    async def go():
        p = Pair()
        await p.prepared()
        await p.src.release(["s1", "s2"], "t1", "http://dst:2")
        assert p.src.state("t1")["outgoing"] == "released" and p.src_engine.released == ["s1", "s2"]
        p.clock.now += 5 * TTL
        await p.src.sweep()
        assert p.src_engine.paused == {"s1", "s2"}  # released, never resumed here
        await p.src.abort("t1")  # a late abort changes nothing
        assert p.src.state("t1")["outgoing"] == "released" and p.src_engine.paused == {"s1", "s2"}

    run(go())


def test_one_outgoing_at_a_time_and_final_round_once():
    async def go():
        p = Pair()
        await p.round("t1")
        with pytest.raises(TransferConflict, match="one outgoing migration at a time"):
            await p.src.export("t2", None)
        assert p.src.migrating_out() == "t1"
        await p.round("t1", final=True)
        with pytest.raises(TransferConflict, match="already ran its final round"):
            await p.src.export("t1", None)
        q = Pair()
        with pytest.raises(UnknownSession, match="s9"):
            await q.src.export("t3", ["s9"])

    run(go())


def test_abort_resumes_what_the_final_round_paused():
    async def go():
        p = Pair()
        await p.prepared()
        await p.src.abort("t1")
        assert p.src.state("t1")["outgoing"] == "aborted" and p.src_engine.paused == set()
        assert p.src.migrating_out() is None

    run(go())


def test_abort_and_expiry_in_pre_copy_end_the_transfer_on_both_sides():
    async def go():
        p = Pair()
        await p.dst.import_round("t1", _pieces(await p.src.export("t1", None)), False, "http://src:1")
        assert (p.src.state("t1")["outgoing"], p.dst.state("t1")["incoming"]) == ("active", "receiving")
        await p.src.abort("t1")
        await p.dst.abort("t1")
        assert (p.src.state("t1")["outgoing"], p.dst.state("t1")["incoming"]) == ("aborted", "aborted")
        await p.dst.import_round("t2", _pieces(await p.src.export("t2", None)), False, "http://src:1")
        p.clock.now += 10 * TTL  # nobody drives t2 any more: both leases lapse
        await p.src.sweep()
        await p.dst.sweep()
        assert (p.src.state("t2")["outgoing"], p.dst.state("t2")["incoming"]) == ("expired", "expired")

    run(go())


def test_retried_round_resends_only_chunks_the_target_lacks():
    async def go():
        p, dec, got = Pair(), FrameDecoder(), []
        frames = await p.src.export("t1", None)
        while len(got) < 2:  # the two sessions' chunk frames (pieces: a head, a chunk); then the link is cut
            got += dec.feed(next(frames))
        frames.close()
        assert [f.kind for f in got] == ["chunk", "chunk"]  # the target acknowledges holding the first:
        again = FrameDecoder().feed(b"".join(bytes(f) for f in await p.src.export("t1", None, have=[got[0].ref.hash])))
        assert [(f.ref, bytes(f.payload)) for f in again if f.kind == "chunk"] == [(got[1].ref, bytes(got[1].payload))]

    run(go())


def test_pushed_round_counts_as_sent_only_once_delivered():
    """A round framed in full but not delivered is not taken as sent, nor undone by an overtaken one."""
    async def go():
        p = Pair()
        framed = list(await p.src.export("t1", None, confirm_on_delivery=True))  # never delivered
        chunks = [f for f in framed if f[:4] == b"RLC1"]
        assert len(chunks) == 2
        stale = await p.src.export("t1", None, have=[], confirm_on_delivery=True)
        again = await p.src.export("t1", None, have=[], confirm_on_delivery=True)
        list(stale)  # the overtaken round finishes framing after its retry started
        sent = list(again)
        assert [f for f in sent if f[:4] == b"RLC1"] == chunks
        reply = await p.src.push("t1", p.dst.import_round("t1", _pieces(sent), False, "http://src:1"))
        sent_upto = p.src.outgoing["t1"].sent_upto
        assert reply["sessions"] and len(sent_upto) == 2 and all(sent_upto.values())  # delivered: counted as sent
        assert not [f for f in await p.src.export("t1", None, confirm_on_delivery=True) if f[:4] == b"RLC1"]

    run(go())


# ---- target: receiving, commit, aborts ----------------------------------------------------------------
def test_commit_is_idempotent():
    async def go():
        p = Pair()
        await p.prepared()
        assert p.dst.state("t1")["incoming"] == "placed"
        assert await p.dst.commit("t1") == {"sessions": ["s1", "s2"]}
        assert await p.dst.commit("t1") == {"sessions": [], "already": "committed"}
        assert p.dst_engine.running == ["s1", "s2"] and p.dst.state("t1")["incoming"] == "committed"
        await p.dst.abort("t1")  # after the commit an abort is a no-op
        assert p.dst_engine.aborted == [] and p.dst.state("t1")["incoming"] == "committed"

    run(go())


def test_commit_refused_before_final_and_for_unknown():
    async def go():
        p = Pair()
        await p.round("t1")
        with pytest.raises(TransferConflict, match="has not run its final round"):
            await p.dst.commit("t1")
        with pytest.raises(UnknownTransfer):
            await p.dst.commit("nope")

    run(go())


@pytest.mark.parametrize("phase", ["receiving", "placed"])
def test_abort_frees_the_target(phase):
    async def go():
        p = Pair()
        if phase == "receiving":
            await p.round("t1")
        else:
            await p.prepared()
        assert p.dst.state("t1")["incoming"] == phase
        await p.dst.abort("t1")
        assert p.dst_engine.aborted == ["t1"] and p.dst.state("t1")["incoming"] == "aborted"
        with pytest.raises(TransferConflict, match=r"\(aborted\)"):
            await p.dst.commit("t1")
        with pytest.raises(TransferConflict, match="already ended"):
            p.dst.open_import("t1")

    run(go())


def test_incoming_expires_before_final():
    async def go():
        p = Pair()
        await p.round("t1")
        p.clock.now += TTL + 1
        await p.dst.sweep()
        assert p.dst.state("t1")["incoming"] == "expired" and p.dst_engine.aborted == ["t1"]
        assert p.asked == []  # nothing placed: nobody to ask

    run(go())


@pytest.mark.parametrize("answer,ends", [("released", "committed"), (None, "committed"),
                                         ("aborted", "expired"), ("expired", "expired")])
def test_in_doubt_after_final_asks_the_source(answer, ends):
    async def go():
        p = Pair(ask_answer=answer)
        await p.prepared()
        p.clock.now += TTL + 1
        await p.dst.sweep()
        assert p.asked == [] and p.dst.state("t1")["incoming"] == "placed"  # within 2 ttl: wait
        p.clock.now += TTL
        await p.dst.sweep()
        assert p.asked == [("http://src:1", "t1")]
        assert p.dst.state("t1")["incoming"] == ends
        assert p.dst_engine.running == (["s1", "s2"] if ends == "committed" else [])
        assert p.dst_engine.aborted == ([] if ends == "committed" else ["t1"])

    run(go())


@pytest.mark.parametrize("answer", [RuntimeError("unreachable"), "active"])
def test_in_doubt_with_no_verdict_drops_after_long(answer):
    async def go():
        p = Pair(ask_answer=answer)
        await p.prepared()
        p.clock.now += 2 * TTL + 1
        for _ in range(5):
            await p.dst.sweep()
            p.clock.now += TTL
        assert p.dst.state("t1")["incoming"] == "placed" and len(p.asked) == 5  # still asking
        p.clock.now += 6 * TTL
        await p.dst.sweep()
        assert p.dst.state("t1")["incoming"] == "expired" and p.dst_engine.aborted == ["t1"]

    run(go())


def test_in_doubt_without_a_source_drops():
    async def go():
        p = Pair()
        await p.prepared(source=None)
        p.clock.now += 2 * TTL + 1
        await p.dst.sweep()
        assert p.asked == [] and p.dst.state("t1")["incoming"] == "expired"

    run(go())


def test_max_transfers_and_import_limits():
    async def go():
        p = Pair(max_transfers=2, import_limit=4000, frame_limit=1 << 20)  # the round's total is checked
        p.dst.open_import("a")
        p.dst.open_import("b")
        with pytest.raises(TooManyTransfers):
            p.dst.open_import("c")
        with pytest.raises(ImportTooLarge, match="4001 bytes"):
            p.dst.open_import("a", declared=4001)
        with pytest.raises(ImportTooLarge, match="sent more"):  # a round bigger than declared
            await p.round("a")
        assert p.dst.state("a")["incoming"] == "aborted"

    run(go())


def test_round_cut_keeps_a_precopy_transfer_and_drops_a_final_one():
    async def cut_after(frames, n) -> AsyncIterator[bytes]:
        dec, done = FrameDecoder(), 0
        while done < n:  # the pieces of n whole frames; the source's stream stops there too
            done += len(dec.feed(piece := next(frames)))
            yield piece
        frames.close()
        raise RoundCut()

    async def go():
        p = Pair()
        with pytest.raises(RoundCut):
            await p.dst.import_round("t1", cut_after(await p.src.export("t1", None), 1), False, "http://src:1")
        st = p.dst.state("t1")
        assert st["incoming"] == "receiving" and len(st["chunks"]) == 1  # resume after the acknowledged chunk
        final = await p.src.export("t1", None, pause=True, have=st["chunks"])
        with pytest.raises(RoundCut):
            await p.dst.import_round("t1", cut_after(final, 1), True)
        assert p.dst.state("t1")["incoming"] == "aborted" and p.dst_engine.aborted == ["t1"]

    run(go())


def _read_from(data: bytes):
    """A link's `read_into` over `data` (a RoundCut past its end)."""
    view, at = memoryview(data), [0]

    def read_into(buf: memoryview) -> int:
        n = min(len(buf), len(view) - at[0])
        if not n:
            raise RoundCut()
        buf[:n] = view[at[0]:at[0] + n]
        at[0] += n
        return n

    return read_into


def test_a_link_round_whose_go_ahead_fails_leaves_the_transfer_as_it_was():
    """The source went away between its hello and the go-ahead: nothing of the round was read, so the
    transfer (and the chunks earlier rounds brought) stays for the migrator's retry, and no round is
    counted in any more (a later drop frees it at once). The retry, read on the link's thread, imports."""
    async def go():
        p = Pair()
        await p.round("t1")
        frames = b"".join(await p.src.export("t1", None))
        loop = asyncio.get_running_loop()

        def go_on() -> None:
            raise ConnectionResetError("the source went away")

        with pytest.raises(ConnectionResetError):
            await asyncio.to_thread(p.dst.import_link_round, "t1", _read_from(frames), False, "http://src:1", {},
                                    loop, go_on)
        assert p.dst.state("t1")["incoming"] == "receiving" and p.dst.incoming["t1"].receiving == 0
        assert p.dst_engine.aborted == []
        reply = await asyncio.to_thread(p.dst.import_link_round, "t1", _read_from(frames), False, "http://src:1",
                                        {}, loop, None)
        assert reply["sessions"] == ["s1", "s2"] and p.dst.incoming["t1"].receiving == 0
        await p.dst.abort("t1")
        assert p.dst_engine.aborted == ["t1"]

    run(go())


def test_garbled_round_drops_the_transfer():
    async def go():
        p = Pair()
        frames = [bytes([b ^ 0xFF for b in f]) for f in await p.src.export("t1", None)]
        with pytest.raises(CorruptCheckpoint):
            await p.dst.import_round("t1", _pieces(frames), False)
        assert p.dst.state("t1")["incoming"] == "aborted"

    run(go())


# ---- the frame sink ------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["none", "zstd", "zstd-planes"])
def test_frame_sink_frames_what_the_plain_writer_writes(codec):
    sink = FrameSink(set())
    w = CheckpointWriter(sink, "c1", codec=codec)
    for layer in range(2):
        w.put_kv("s1", layer, 0, 2, 0, 16, torch.randn(2, 2, 16, 16))
    w.put_kv("s1", 0, 0, 2, 16, 32, torch.zeros(2, 2, 16, 16))
    w.put_kv("s1", 1, 0, 2, 16, 32, torch.zeros(2, 2, 16, 16))  # same bytes: framed once
    w.add_session("s1", {}, 32)
    m = w.commit(MODEL, {}, KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32"))
    frames = sink.take()
    decoded = FrameDecoder().feed(b"".join(frames))
    assert [f.kind for f in decoded] == ["chunk"] * 3 + ["manifest"]
    refs = {e.chunk.hash: e.chunk for e in m.kv_entries}
    assert len(refs) == 3 and all(f.ref == refs[f.ref.hash] for f in decoded if f.ref)  # the manifest's refs
    store = MemoryStore()
    recv = StreamReceiver(store)
    recv.feed(b"".join(frames))
    assert recv.close().checkpoint_id == "c1" and len(store.chunk_hashes()) == 3

