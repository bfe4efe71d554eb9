"""`relayout plan`: expert load + fleet topology -> layout, device set and the reason (docs/layouts.md).

agent/cli.py wires the command; this module does the work and formats the answer.
"""

from __future__ import annotations

from relayout.migrate.attention_split import choose_attention_split
from relayout.migrate.placeable import NotPlaceable, ReplicaNeeds, find_placeable_sets
from relayout.migrate.planner import (
    PlanError,
    balance,
    cross_node_bytes,
    eplb_baseline,
    plan_placement,
    redundant_for,
    to_layout,
)
from relayout.migrate.topology import Topology, TopologyError
from rich.table import Table


def plan_main(input_json: dict) -> dict:
    """{topology, load, needs, concurrency?, latency_target_ms?, measurements?, redundant_slots?,
    coact?, hidden_bytes?, model?} -> {placement, layout, devices, reason, ...} or {error}."""
    try:
        return _plan(input_json)
    except NotPlaceable as e:
        return {"error": e.reason}
    except (PlanError, TopologyError, ValueError, KeyError, TypeError) as e:
        msg = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        return {"error": msg}


def _plan(inp: dict) -> dict:
    topo_in = inp["topology"]
    topo = Topology.load(topo_in) if isinstance(topo_in, str) else Topology.from_dict(topo_in)
    load = [[float(x) for x in row] for row in inp["load"]]
    nd = inp["needs"]
    needs = ReplicaNeeds(int(nd["devices"]), float(nd.get("memory_gb_per_device", 0)),
                         float(nd.get("min_exchange_gbps", 0)))
    best = find_placeable_sets(topo, needs)[0]
    world = needs.devices
    node_of = [i for i, n in enumerate(best.devices_per_node) for _ in range(n)]
    E = len(load[0]) if load else 0
    redundant = int(inp.get("redundant_slots", redundant_for(E, world)))
    coact = inp.get("coact")
    placement = plan_placement(load, world, max(best.devices_per_node), redundant, coact, node_of=node_of)
    if inp.get("measurements") and inp.get("concurrency"):
        ch = choose_attention_split(world, int(inp["concurrency"]), float(inp.get("latency_target_ms", 50.0)),
                                    inp["measurements"])
        dp, tp, attn_reason = ch.attn_dp, ch.attn_tp, ch.reason
    else:
        dp, tp = world, 1
        attn_reason = "no attention measurements given: data parallel attention (attn_dp = world size)"
    cfg = None
    if inp.get("model"):
        from relayout.engine.config import ModelConfig
        from relayout.engine.weights import resolve_model

        cfg = ModelConfig.from_dir(resolve_model(inp["model"]))
    layout = to_layout(placement, dp, tp, world, 1, cfg=cfg)
    if cfg is not None:
        layout.validate(cfg)
    hb = int(inp.get("hidden_bytes", 1))
    if len(set(best.devices_per_node)) == 1:
        base = eplb_baseline(load, world, best.devices_per_node[0], redundant)
    else:
        base = eplb_baseline(load, world, world, redundant)
    base.node_of = list(node_of)  # score the baseline on the real nodes
    gained = sum(s == "planner" for s in placement.source)
    reason = (f"devices: {best.reason}. attention: {attn_reason}. experts: {redundant} redundant slots; "
              f"planner beats the EPLB-style baseline on {gained} of {len(load)} layers (kept the baseline elsewhere)")
    return {
        "placement": placement.phy2log,
        "layout": layout.to_dict(),
        "layout_str": str(layout),
        "devices": best.devices,
        "nodes": best.nodes,
        "min_bandwidth_gbps": best.min_bandwidth_gbps,
        "balance": round(balance(placement, load), 4),
        "baseline_balance": round(balance(base, load), 4),
        "cross_node_bytes": cross_node_bytes(placement, load, None, hb, coact),
        "baseline_cross_node_bytes": cross_node_bytes(base, load, None, hb, coact),
        "reason": reason,
    }


def format_plan_table(result: dict) -> Table:
    if "error" in result:
        t = Table(title="relayout plan: not placeable")
        t.add_column("reason")
        t.add_row(result["error"])
        return t
    t = Table(title="relayout plan")
    t.add_column("field")
    t.add_column("value")
    t.add_row("layout", result["layout_str"])
    t.add_row("devices", ", ".join(result["devices"]))
    t.add_row("nodes", ", ".join(result["nodes"]))
    t.add_row("slowest pair", f"{result['min_bandwidth_gbps']:g} GB/s")
    t.add_row("balance (planner / baseline)", f"{result['balance']:.3f} / {result['baseline_balance']:.3f}")
    t.add_row("cross-node bytes (planner / baseline)",
              f"{result['cross_node_bytes']:.0f} / {result['baseline_cross_node_bytes']:.0f}")
    for i, row in enumerate(result["placement"]):
        t.add_row(f"layer {i} phy2log", " ".join(map(str, row)))
    t.add_row("reason", result["reason"])
    return t
