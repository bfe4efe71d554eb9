"""The target's pre-step (LLMEngine.prestep): sessions a migration's final round placed, held until
the commit, compute their next token in the target's next step; the token is kept back until the
commit (then it is the session's next token, exactly the undisturbed one) and dies with the
session if the migration aborts instead. Real engines, the real final round (engine.moves.receive)."""

from __future__ import annotations

import pytest
from relayout.engine.moves.receive import abort_incoming, commit_incoming, receive_round
from relayout.engine.moves.snapshot import geometry, model_ref, take_snapshot, write_snapshot
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams, SessionStatus
from relayout.storage.checkpoint import CheckpointWriter
from relayout.storage.stores import MemoryStore

from tests.helpers.migration import Incoming

PROMPT = list(range(5, 60))
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, top_p=0.9, seed=11)
OTHER = list(range(70, 90))


def undisturbed(params: SamplingParams) -> list[int]:
    e = LLMEngine("builtin:tiny")
    try:
        return e.generate([PROMPT], [params])[0]
    finally:
        e.shutdown()


def placed_on(dst: LLMEngine, params: SamplingParams, decoded: int = 6) -> tuple[Incoming, list[int]]:
    """A session decodes `decoded` tokens on a source, pauses, and its one final round places it on
    `dst`, held. Returns the transfer and the tokens it made on the source."""
    src = LLMEngine("builtin:tiny", "attn_dp=1")
    try:
        s = src.add_session(PROMPT, params, session_id="s")
        while len(s.output_token_ids) < decoded:
            src.step()
        src.pause(["s"])
        w = CheckpointWriter(store := MemoryStore(), "final")
        write_snapshot(take_snapshot(src, ["s"]), w)
        m = w.commit(model_ref(src), src.layout.to_dict(), geometry(src))
        t = Incoming(store=store)
        receive_round(dst, t, m, final=True)
        return t, list(s.output_token_ids)
    finally:
        src.shutdown()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prestep_token_kept_back_until_commit_then_exactly_the_undisturbed_one(params: SamplingParams) -> None:
    want = undisturbed(params)
    dst = LLMEngine("builtin:tiny", "attn_tp=2")
    try:
        other = dst.add_session(OTHER, GREEDY, session_id="other")  # the target serves others meanwhile
        dst.step()
        t, before = placed_on(dst, params)
        s = dst.sessions["s"]
        assert s.status == SessionStatus.PAUSED and dst.has_work()
        n_other = len(other.output_token_ids)
        events = dst.step()  # the pre-step, batched with the other session's decode
        assert [ev.session_id for ev in events] == ["other"] and len(other.output_token_ids) == n_other + 1
        assert "s" in dst.held_tokens and s.output_token_ids == before, "the held token must not show"
        assert s.num_computed == s.num_tokens - 1  # its position counts only once the token is its own
        for _ in range(2):  # no second pre-step while still held
            assert [ev.session_id for ev in dst.step()] == ["other"]
        assert s.output_token_ids == before
        assert commit_incoming(dst, t) == ["s"]
        assert s.output_token_ids == want[: len(before) + 1] and s.status == SessionStatus.RUNNING
        while dst.has_work() and not s.is_finished:
            dst.step()
        assert s.output_token_ids == want
    finally:
        dst.shutdown()


def test_prestep_of_an_aborted_migration_leaves_nothing() -> None:
    dst = LLMEngine("builtin:tiny", "attn_tp=2")
    try:
        used = dst.kv_blocks_used()
        t, before = placed_on(dst, SEEDED)
        dst.step()
        assert "s" in dst.held_tokens
        abort_incoming(dst, t)
        assert "s" not in dst.sessions and not dst.held_tokens and not dst.scheduler.prestep
        assert dst.kv_blocks_used() == used and not dst.has_work()
    finally:
        dst.shutdown()


def test_commit_before_the_prestep_ran_continues_normally() -> None:
    want = undisturbed(GREEDY)
    dst = LLMEngine("builtin:tiny", "attn_tp=2")
    try:
        t, before = placed_on(dst, GREEDY)
        assert dst.scheduler.prestep == {"s"}
        commit_incoming(dst, t)  # the commit landed before the engine stepped
        assert not dst.scheduler.prestep and not dst.held_tokens
        s = dst.sessions["s"]
        assert s.output_token_ids == before
        while not s.is_finished:
            dst.step()
        assert s.output_token_ids == want
    finally:
        dst.shutdown()


def test_held_token_that_ends_the_session_finishes_it_at_commit() -> None:
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    want = undisturbed(params)
    dst = LLMEngine("builtin:tiny")
    try:
        t, before = placed_on(dst, params)
        assert len(before) == 6
        dst.step()
        s = dst.sessions["s"]
        assert not s.is_finished
        commit_incoming(dst, t)
        assert s.is_finished and s.finish_reason == "length" and s.output_token_ids == want
        assert not dst.has_work()
    finally:
        dst.shutdown()
