"""`relayout bench placement`: planner vs EPLB-style baseline on the same load traces (docs/benchmarks.md).

Traces: synthetic skewed routing (Zipf popularity at a few exponents, experts that fire together
in clusters not aligned with expert ids, a drifting hot set folded in by ExpertLoad's moving
average) and a trace recorded from our own engine running builtin:tiny. Each trace is planned
on three topologies; `cross_node_bytes` uses the node-deduplicated dispatch model of
migrate.planner with one token copy = `hidden_bytes`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from relayout.migrate.planner import (
    ExpertLoad,
    balance,
    cross_node_bytes,
    eplb_baseline,
    plan_placement,
    redundant_for,
)
from rich.console import Console
from rich.table import Table

TOPOLOGIES = {"1x8": (1, 8), "2x4": (2, 4), "4x4": (4, 4)}


@dataclass
class Trace:
    name: str
    load: list[list[float]]
    coact: list[np.ndarray] | None
    hidden_bytes: int


def _route(rng: np.random.Generator, pop: np.ndarray, clusters: list[np.ndarray], tokens: int, k: int,
           p_in: float) -> tuple[np.ndarray, np.ndarray]:
    """Sample top-k routing: a token picks a topic cluster, then k distinct experts, each from
    the cluster with probability p_in (else from all), by popularity. Returns counts, coact."""
    E = len(pop)
    cpop = np.array([pop[c].sum() for c in clusters])
    topic = rng.choice(len(clusters), size=tokens, p=cpop / cpop.sum())
    chosen = np.full((tokens, k), -1)
    for j in range(k):
        for _ in range(20):  # redraw collisions with the token's earlier picks
            todo = np.nonzero(chosen[:, j] < 0)[0]
            if len(todo) == 0:
                break
            glob = rng.random(len(todo)) >= p_in
            pick = rng.choice(E, size=len(todo), p=pop / pop.sum())
            for c, members in enumerate(clusters):
                m = ~glob & (topic[todo] == c)
                pick[m] = rng.choice(members, size=int(m.sum()), p=pop[members] / pop[members].sum())
            clash = (chosen[todo, :j] == pick[:, None]).any(axis=1)
            chosen[todo[~clash], j] = pick[~clash]
    chosen = chosen[(chosen >= 0).all(axis=1)]
    counts = np.bincount(chosen.ravel(), minlength=E).astype(float)
    coact = np.zeros((E, E))
    for a in range(k):
        for b in range(a + 1, k):
            np.add.at(coact, (chosen[:, a], chosen[:, b]), 1.0)
    return counts, coact + coact.T


def synthetic(name: str, s: float, *, experts: int = 64, layers: int = 8, tokens: int = 4000, k: int = 2,
              clusters: int = 8, p_in: float = 0.7, drift: int = 0, seed: int = 0) -> Trace:
    """Zipf(s) popularity over a random expert order per layer; `drift` > 0 moves the hot set
    over that many windows, folded in by ExpertLoad's moving average."""
    rng = np.random.default_rng(seed)
    el = ExpertLoad()
    windows = max(1, drift)
    perms = [rng.permutation(experts) for _ in range(layers)]
    groups = [np.array_split(rng.permutation(experts), clusters) for _ in range(layers)]
    for w in range(windows):
        counts, coacts = [], []
        for layer in range(layers):
            rank = np.roll(perms[layer], w * experts // (2 * windows))  # hot set shifts each window
            pop = np.empty(experts)
            pop[rank] = 1.0 / np.arange(1, experts + 1) ** s
            c, co = _route(rng, pop, groups[layer], tokens // windows, k, p_in)
            counts.append(c.tolist())
            coacts.append(co)
        el.update(counts, alpha=0.5, coact=coacts)
    assert el.load is not None
    return Trace(name, el.load, el.coact, hidden_bytes=4096 * 2)  # bf16, hidden 4096


def engine_trace(prompts: int = 6, max_tokens: int = 8) -> Trace:
    """Routing recorded from LLMEngine('builtin:tiny'): counts from expert_stats(), co-activation
    by watching the router's top-k picks."""
    from relayout.engine.engine import LLMEngine
    from relayout.engine.moe import SparseMoE
    from relayout.engine.session import SamplingParams

    eng = LLMEngine("builtin:tiny")
    E, L = eng.cfg.num_experts, eng.cfg.num_layers
    coact = [np.zeros((E, E)) for _ in range(L)]
    model = getattr(getattr(eng.executor, "runner", None), "model", None)
    for i, layer in enumerate(getattr(model, "layers", [])):
        if isinstance(layer.mlp, SparseMoE):
            orig = layer.mlp.route

            def route(x, _orig=orig, _c=coact[i]):
                w, e = _orig(x)
                ee = e.cpu().numpy()
                for a in range(ee.shape[1]):
                    for b in range(a + 1, ee.shape[1]):
                        np.add.at(_c, (ee[:, a], ee[:, b]), 1.0)
                return w, e

            layer.mlp.route = route  # instance attribute shadows the method for this engine only
    texts = ["The quick brown fox", "Mixture of experts routes tokens", "live migration of sessions",
             "def main():\n    return 0", "1, 2, 3, 4, 5, 6", "relayout moves KV caches between layouts"]
    ids = [list(t.encode())[:48] for t in (texts * (prompts // len(texts) + 1))[:prompts]]
    eng.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True))
    counts = eng.expert_stats()["expert_counts"]
    eng.shutdown()
    co = [c + c.T for c in coact] if model is not None else None
    return Trace("engine-tiny", [[float(c) for c in row] for row in counts], co,
                 hidden_bytes=eng.cfg.hidden_size * 4)


def default_traces(include_engine: bool = True) -> list[Trace]:
    tr = [synthetic("zipf0.6", 0.6, seed=1), synthetic("zipf1.0", 1.0, seed=2), synthetic("zipf1.4", 1.4, seed=3),
          synthetic("drift1.0", 1.0, drift=4, seed=4)]
    if include_engine:
        tr.append(engine_trace())
    return tr


def evaluate(trace: Trace, topo: str) -> dict:
    nodes, dpn = TOPOLOGIES[topo]
    D = nodes * dpn
    R = redundant_for(len(trace.load[0]), D)
    out = {}
    for name, p in (("planner", plan_placement(trace.load, D, dpn, R, trace.coact)),
                    ("baseline", eplb_baseline(trace.load, D, dpn, R))):
        out[name] = {"balance": round(balance(p, trace.load), 4),
                     "cross_node_bytes": round(cross_node_bytes(p, trace.load, dpn, trace.hidden_bytes, trace.coact)),
                     "placement": p}
    return out


def run_bench(json_out: bool = False, include_engine: bool = True) -> dict:
    results: dict[str, dict] = {}
    table = Table(title="placement: planner vs EPLB-style baseline")
    for col in ("trace", "topo", "bal plan", "bal base", "xnode MB plan", "xnode MB base", "saved"):
        table.add_column(col, justify="left" if col in ("trace", "topo") else "right")
    for tr in default_traces(include_engine):
        for topo in TOPOLOGIES:
            r = evaluate(tr, topo)
            for v in r.values():
                v.pop("placement")
            results[f"{tr.name}@{topo}"] = r
            pb, bb = r["planner"]["cross_node_bytes"], r["baseline"]["cross_node_bytes"]
            table.add_row(tr.name, topo, f"{r['planner']['balance']:.3f}", f"{r['baseline']['balance']:.3f}",
                          f"{pb / 1e6:.2f}", f"{bb / 1e6:.2f}", f"{(1 - pb / bb) * 100:.1f}%" if bb else "-")
    out = {"bench": "placement", "traces": results,
           "model": "balance = mean/max device load per layer, averaged; cross_node_bytes = node-deduplicated "
                    "dispatch copies x hidden bytes"}
    Console(stderr=json_out).print(table)
    if json_out:
        print(json.dumps(out))
    return out
