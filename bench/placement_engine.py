"""`relayout bench placement --engine`: a planned placement run in a real multi-rank replica, its
measured balance and cross-rank traffic next to what the planner's model (migrate.placement.dispatch_model)
predicts for the same routed tokens (docs/benchmarks.md).

A skewed workload (prompts drawn from a few hot token ids) is routed once on one rank to record each
layer's expert load; the planner places the experts for each layout from that load; the replica runs
the same workload under the planned layout (its ranks real processes over gloo) and reports, per
layer, the (token, expert) pairs each expert-parallel rank computed (`rank_pairs`) and the bytes of
the exchange between ranks. The model is given the same layer loads (tokens evenly spread over the
ranks, as attention data parallelism spreads sessions) and predicts per-rank load (`balance`: mean
over max, averaged over layers) and the fraction of pairs that leave their rank (`cross_rank`).
Tokens are checked equal to one rank's."""

from __future__ import annotations

import random

import numpy as np
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.weights import resolve_model
from relayout.migrate.placement.dispatch_model import layer_dispatch
from relayout.migrate.placement.planner import plan_placement, redundant_for, to_layout
from rich.console import Console
from rich.table import Table

LAYOUTS = (2, 4)  # expert-parallel ranks: attn_dp=N, moe_ep=N
MODEL = "builtin:tiny"


def workload(sessions: int, seed: int = 0) -> list[list[int]]:
    """Prompts over a few hot token ids: a routing skewed towards some experts."""
    rnd = random.Random(seed)
    hot = rnd.sample(range(3, 250), 6)
    return [[rnd.choice(hot) if rnd.random() < 0.85 else rnd.randrange(3, 250) for _ in range(48)]
            for _ in range(sessions)]


def _run(layout, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams

    e = LLMEngine(MODEL, layout)
    try:
        ss = [e.add_session(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
        while any(not s.is_finished for s in ss):
            e.step()
        return [s.output_token_ids for s in ss], e.expert_stats()
    finally:
        e.shutdown()


def predicted_cross_rank(row: list[int], load: np.ndarray, D: int) -> float:
    """The model's fraction of (token, expert) pairs that leave their rank: a rank's tokens of an expert it
    holds no copy of (the rule keeps every other pair home)."""
    spd = len(row) // D
    has = np.zeros((D, len(load)), dtype=bool)
    for s, e in enumerate(row):
        has[s // spd, e] = True
    total = float(load.sum())
    return float(((~has) * (load / D)[None, :]).sum() / total) if total else 0.0


def run(sessions: int = 8, max_tokens: int = 32, log=print) -> dict:
    cfg = ModelConfig.from_dir(resolve_model(MODEL))
    prompts = workload(sessions)
    ref, stats = _run("attn_dp=1", prompts, max_tokens)
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    load = [stats["expert_counts"][i] for i in moe]
    out: dict = {"bench": "placement-engine", "model": MODEL, "sessions": sessions, "max_tokens": max_tokens,
                 "layouts": {}}
    for D in LAYOUTS:
        plan = plan_placement(load, D, D, redundant_for(cfg.num_experts, D))  # one node: the replica's ranks
        layout = to_layout(plan, attn_dp=D, attn_tp=1, moe_ep=D, cfg=cfg)
        log(f"attn_dp={D},moe_ep={D} with the planned placement")
        toks, st = _run(layout, prompts, max_tokens)
        meas_bal, pred_bal = [], []
        pairs_all, cross_pairs, pred_cross_w = 0.0, 0.0, 0.0
        for j, layer in enumerate(moe):
            lv = np.asarray(st["expert_counts"][layer], dtype=float)
            got = np.asarray(st["rank_pairs"][layer], dtype=float)  # pairs each rank's experts computed
            want, _ = layer_dispatch(plan.phy2log[j], lv, D, [0] * D)
            meas_bal.append(got.mean() / got.max() if got.max() else 1.0)
            pred_bal.append(want.mean() / want.max() if want.max() else 1.0)
            sent = np.asarray(st["rank_pairs_from"][layer], dtype=float)  # [src][dst]
            pairs_all += sent.sum()
            cross_pairs += sent.sum() - np.trace(sent)
            pred_cross_w += predicted_cross_rank(plan.phy2log[j], lv, D) * lv.sum()
        mb, pb = float(np.mean(meas_bal)), float(np.mean(pred_bal))
        mc = cross_pairs / pairs_all if pairs_all else 0.0
        pc = pred_cross_w / max(1.0, sum(float(np.sum(st["expert_counts"][i])) for i in moe))
        out["layouts"][f"attn_dp={D},moe_ep={D}"] = {
            "exact": toks == ref,
            "measured_balance": round(mb, 4), "predicted_balance": round(pb, 4),
            "balance_error": round(abs(mb - pb) / pb, 4) if pb else None,
            "measured_cross_rank": round(mc, 4), "predicted_cross_rank": round(pc, 4),
            "cross_rank_error": round(abs(mc - pc), 4),
            "a2a_bytes": st["a2a_bytes"],
        }
    return out


def print_table(res: dict, console: Console) -> None:
    t = Table(title=f"planned placements in a real replica ({res['model']}, {res['sessions']} sessions)")
    for col in ("layout", "balance measured", "predicted", "cross-rank measured", "predicted", "exact"):
        t.add_column(col, justify="right")
    for name, r in res["layouts"].items():
        t.add_row(name, f"{r['measured_balance']:.3f}", f"{r['predicted_balance']:.3f}",
                  f"{r['measured_cross_rank']:.3f}", f"{r['predicted_cross_rank']:.3f}", "yes" if r["exact"] else "NO")
    console.print(t)
