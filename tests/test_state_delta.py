"""A protection round sends only the new items of a session's growing lists (SessionEntry.state_from):
the standby makes the state whole from the round it holds, and a reader never takes such a round for
a checkpoint. The states here are a real engine's, cut round after round as the Replicator cuts them."""

from __future__ import annotations

import pytest
from relayout.engine.moves.snapshot import geometry, model_ref, take_snapshot, write_snapshot
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams
from relayout.migrate.protection.replication import SyncedSession
from relayout.migrate.transport.frame_sink import FrameSink
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.manifest import KVGeometry, Manifest
from relayout.storage.stores import MemoryStore

from tests.helpers.checkpoints import LAYOUT, MODEL, D, H, L, kv_tensor


def _rounds(n: int) -> list[tuple[Manifest, dict[str, dict]]]:
    """`n` protection rounds of 3 sessions, 8 steps apart: (the round's manifest, the whole states cut)."""
    eng = LLMEngine("builtin:tiny", None)
    for i in range(3):
        sp = SamplingParams(max_tokens=200, ignore_eos=True, logprobs=2 if i == 2 else None)
        eng.add_session(list(range(5, 12 + 9 * i)), sp)
    out, sent, held = [], {}, {}
    for rnd in range(n):
        for _ in range(8):
            eng.step()
        snaps = take_snapshot(eng, None, sent, None, True, False)
        w = CheckpointWriter(FrameSink(set()), f"p-r{rnd}", kv_from=sent, state_from=held)
        write_snapshot(snaps, w, sent)
        m = w.commit(model_ref(eng), eng.layout.to_dict(), geometry(eng), {"round": rnd})
        whole = {s.session_id: s.state_dict for s in snaps}
        synced = {e.session_id: SyncedSession.of(e.num_kv_tokens, whole[e.session_id]) for e in m.sessions}
        sent = {sid: s.kv_tokens for sid, s in synced.items()}
        held = {sid: s.lists for sid, s in synced.items()}
        out.append((m, whole))
    return out


def test_rounds_carry_only_new_items_and_the_standby_makes_them_whole() -> None:
    rounds = _rounds(4)
    first, whole0 = rounds[0]
    assert all(not s.state_from for s in first.sessions) and b"state_from" not in first.to_bytes()
    holds = first
    for m, whole in rounds[1:]:
        for s in m.sessions:
            before = holds.session(s.session_id).state
            # only what the standby does not hold: no prompt, the 8 new tokens (and their logprobs)
            assert s.state_from["prompt_token_ids"] == len(before["prompt_token_ids"])
            assert s.state["prompt_token_ids"] == []
            assert len(s.state["output_token_ids"]) == 8
            assert len(s.state["logprobs"]) == (8 if before["logprobs"] else 0)
        holds = m.with_whole_states(holds)
        assert {s.session_id: s.state for s in holds.sessions} == whole
        assert all(not s.state_from for s in holds.sessions)
    # a round's manifest stays small: it does not grow with the sessions' length
    assert len(rounds[-1][0].to_bytes()) <= len(rounds[1][0].to_bytes()) + 64


def test_a_round_that_continues_what_the_receiver_lacks_is_refused() -> None:
    (m0, _), (m1, _), (m2, _) = _rounds(3)
    with pytest.raises(CorruptCheckpoint, match="does not hold"):
        m1.with_whole_states(None)  # a standby that restarted: the source must send it all again
    # a round skipped: what m2 continues is longer than what m0 holds
    with pytest.raises(CorruptCheckpoint, match="'output_token_ids' continues"):
        m2.with_whole_states(m0)
    assert m0.with_whole_states(None) is m0  # nothing to make whole


def test_a_state_delta_is_never_a_checkpoint() -> None:
    store = MemoryStore()
    kv = kv_tensor(3, 6)
    w = CheckpointWriter(store, "round-2", state_from={"s": {"prompt_token_ids": 3, "output_token_ids": 5,
                                                          "absent": 1}})
    for layer in range(L):
        w.put_kv("s", layer, 0, H, 0, 6, kv[layer])
    # a list shorter than what the receiver is said to hold goes whole (no delta for it)
    state = {"prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5], "x": 1.5}
    e = w.add_session("s", state, 6, handed_over=True)
    assert e.state_from == {"prompt_token_ids": 3} and e.state == {"prompt_token_ids": [], "output_token_ids": [4, 5],
                                                                   "x": 1.5}
    m = w.commit(MODEL, LAYOUT, KVGeometry(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32"))
    assert m.coverage_error(from_kv_from=True) is None
    assert "not a checkpoint" in (m.coverage_error() or "")
    with pytest.raises(CorruptCheckpoint, match="not a checkpoint"):
        CheckpointReader(store, "round-2").verify()
    assert state == {"prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5], "x": 1.5}  # the caller's, whole
