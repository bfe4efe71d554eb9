"""Protection rounds as deltas (engine.moves.receive + storage's SessionEntry.kv_from): each round lists a
session's KV from what the receiver holds on; the receiver imports a chain of them into the same
blocks, and refuses a round that does not continue what it holds, reserving nothing."""

from __future__ import annotations

import pytest
from relayout.engine.moves.receive import abort_incoming, receive_round
from relayout.engine.moves.snapshot import RestoreError, geometry, model_ref, take_snapshot, write_snapshot
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams
from relayout.storage.checkpoint import CheckpointWriter
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.manifest import Manifest
from relayout.storage.stores import MemoryStore

from tests.helpers.migration import Incoming

PROMPT = list(range(3, 40))
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def _round(e: LLMEngine, store: MemoryStore, rnd: int, sent: dict[str, int]) -> Manifest:
    snaps = take_snapshot(e, ["s"], sent)
    w = CheckpointWriter(store, f"r{rnd}", kv_from=sent)
    write_snapshot(snaps, w, sent)
    return w.commit(model_ref(e), e.layout.to_dict(), geometry(e))


def test_delta_chain_continues_token_for_token_and_a_gap_is_refused() -> None:
    src, dst = LLMEngine("builtin:tiny"), LLMEngine("builtin:tiny")
    try:
        undisturbed = LLMEngine("builtin:tiny")
        want = undisturbed.generate([PROMPT], [PARAMS])[0]
        undisturbed.shutdown()
        src.add_session(PROMPT, PARAMS, session_id="s")
        t = Incoming()
        sent: dict[str, int] = {}
        for rnd in range(3):  # three rounds, a few decode steps apart
            for _ in range(4):
                src.step()
            m = _round(src, t.store, rnd, sent)
            assert m.session("s").kv_from == sent.get("s", 0)
            assert all(x.tok_lo >= sent.get("s", 0) for x in m.kv_entries)
            receive_round(dst, t, m, final=False)
            sent = {"s": m.session("s").num_kv_tokens}
        assert t.upto["s"] == sent["s"] > 0
        # a delta into a receiver that holds nothing of the session: refused, nothing reserved
        fresh, free = Incoming(), dst.allocators[0].num_free
        m = _round(src, fresh.store, 9, sent)
        with pytest.raises(CorruptCheckpoint, match=f"starts at token {sent['s']}, this replica holds 0"):
            receive_round(dst, fresh, m, final=False)
        assert fresh.blocks == {} and dst.allocators[0].num_free == free
        # the last round places the session: it continues exactly where the source was
        src.pause(["s"])
        m = _round(src, t.store, 10, sent)
        receive_round(dst, t, m, final=True)
        src.release(["s"])
        dst.resume(["s"])
        while not dst.sessions["s"].is_finished:
            dst.step()
        assert dst.sessions["s"].output_token_ids == want
        abort_incoming(dst, fresh)
    finally:
        src.shutdown()
        dst.shutdown()


def test_a_live_round_is_checked_as_a_restore_is() -> None:
    """Live rounds and restores share SessionPlacer's checks: a session that needs more context
    than the target holds is refused in its first round (it would fit the blocks reserved for it
    now, and run out of them later), with nothing reserved."""
    src, dst = LLMEngine("builtin:tiny"), LLMEngine("builtin:tiny", num_blocks=8)  # 127 tokens of context
    try:
        src.add_session(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), session_id="s")
        for _ in range(4):
            src.step()
        t, free = Incoming(), dst.allocators[0].num_free
        m = _round(src, t.store, 0, {})
        with pytest.raises(RestoreError, match="needs more context than this replica's 127"):
            receive_round(dst, t, m, final=False)
        assert t.blocks == {} and dst.allocators[0].num_free == free
    finally:
        src.shutdown()
        dst.shutdown()
