"""Every layout gives world-1 tokens (greedy and seeded) and world-1 logits to 1e-4."""

import os
import signal
import time

import pytest
import torch
from relayout.engine.model.layout import Layout, LayoutError
from relayout.engine.ranks.workers import RankFailure
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams

PROMPTS = [[1, 5, 9], [7] * 20, list(range(10, 47)), [42], list(range(60, 75))]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)

REDUNDANT = {"attn_dp": 2, "moe_ep": 2, "placement": [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]] * 2}
LAYOUTS = ["attn_tp=2", "attn_dp=2,moe_ep=2", "attn_dp=2,attn_tp=2,moe_ep=4", "attn_tp=2,moe_tp=2", REDUNDANT]


def run(model, layout):
    eng = LLMEngine(model, layout, max_prefill_tokens=16)
    logits: dict[str, list[torch.Tensor]] = {}
    eng.logits_hook = lambda sid, lg: logits.setdefault(sid, []).append(lg.clone())
    ss = [eng.add_session(p, GREEDY) for p in PROMPTS] + [eng.add_session(p, SAMPLED) for p in PROMPTS[:2]]
    while eng.has_work():
        eng.step()
    stats = eng.expert_stats()
    eng.shutdown()
    return [s.output_token_ids for s in ss], [logits[s.session_id] for s in ss], stats


@pytest.fixture(scope="module", params=["builtin:tiny", "hf-qwen3moe"])
def reference(request, hf_models):
    model = "builtin:tiny" if request.param == "builtin:tiny" else str(hf_models["qwen3moe"])
    return model, run(model, None)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x if isinstance(x, str) else "redundant-placement")
def test_layout_matches_world1(reference, layout):
    model, (ref_toks, ref_logits, _) = reference
    toks, logits, stats = run(model, Layout.parse(layout))
    assert toks == ref_toks
    for a, b in zip(logits, ref_logits, strict=True):
        for x, y in zip(a, b, strict=True):
            assert (x - y).abs().max() / y.abs().max() < 1e-4
    # each rank counts what it dispatches; the total equals world 1's routing
    assert sum(map(sum, stats["expert_counts"])) > 0


def test_placement_changes_traffic_not_tokens():
    base = Layout.parse("attn_dp=2,moe_ep=2")
    # experts 0-3 on rank 0 by default; move the even ones to rank 0 instead
    moved = Layout.from_dict({"attn_dp": 2, "moe_ep": 2, "placement": [[0, 2, 4, 6, 1, 3, 5, 7]] * 2})
    t1, _, s1 = run("builtin:tiny", base)
    t2, _, s2 = run("builtin:tiny", moved)
    assert t1 == t2
    assert s1["a2a_bytes"] != s2["a2a_bytes"]
    assert s1["expert_counts"] == s2["expert_counts"]  # routing is the model's, not the layout's


@pytest.mark.parametrize("bad,field", [
    ({"attn_dp": 2, "moe_ep": 4}, "moe_ep"),
    ({"attn_tp": 3}, "attn_tp"),
    ({"moe_ep": 2, "attn_dp": 2, "placement": [[0, 1, 2, 3, 4, 5, 6]] * 2}, "placement"),  # expert 7 missing
    ({"moe_ep": 2, "attn_dp": 2, "placement": [[0, 1, 2, 3, 4, 5, 6, 7, 0]] * 2}, "placement"),  # 9 slots / 2
    ({"moe_ep": 2, "attn_dp": 2, "placement": [[0, 1, 2, 3, 4, 5, 6, 7]]}, "placement"),  # 1 of 2 layers
    ({"attn_dp": 0}, "attn_dp"),
    ({"attn_dq": 2}, "attn_dq"),
])
def test_impossible_layout_refused_before_start(bad, field):
    t0 = time.time()
    with pytest.raises(LayoutError) as e:
        LLMEngine("builtin:tiny", Layout.from_dict(bad) if "attn_dq" not in bad else bad)
    assert e.value.field == field
    assert field in str(e.value)
    assert time.time() - t0 < 5  # refused before any rank process starts


def test_layout_cli_form_round_trips():
    lay = Layout.parse("attn_dp=2,attn_tp=1,moe_ep=2,moe_tp=1")
    assert (lay.attn_dp, lay.attn_tp, lay.moe_ep, lay.moe_tp, lay.world_size) == (2, 1, 2, 1, 2)
    assert Layout.parse(str(lay)) == lay
    assert Layout.parse('{"attn_tp": 2, "moe_ep": 2}') == Layout(attn_tp=2, moe_ep=2)


def test_dead_rank_takes_replica_down_with_clear_error():
    eng = LLMEngine("builtin:tiny", "attn_dp=2,moe_ep=2")
    eng.add_session([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
    eng.step()
    os.kill(eng.executor.procs[1].pid, signal.SIGKILL)
    t0 = time.time()
    # named first as the cause, whichever rank's report arrives first (rank 0's gloo read error may)
    with pytest.raises(RankFailure, match="replica down: rank 1 died"):
        for _ in range(1000):
            eng.step()
    assert time.time() - t0 < 30
    assert not any(p.is_alive() for p in eng.executor.procs.values())  # no orphans
