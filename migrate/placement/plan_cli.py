"""`relayout plan`: expert load + fleet topology -> layout, device set and the reason (docs/layouts.md).

agent/cli.py wires the command; this module does the work and formats the answer. A reference
placement to compare with (the CLI passes DeepSeek's EPLB from relayout.bench.eplb) comes in as a
function, so this package never imports the benches.
"""

from __future__ import annotations

from collections.abc import Callable

from relayout.migrate.placement.attention_split import choose_attention_split
from relayout.migrate.placement.placeable import NotPlaceable, ReplicaNeeds, find_placeable_sets
from relayout.migrate.placement.planner import (
    DEFAULT_LOCALITY_WEIGHT,
    Placement,
    PlanError,
    balance,
    check_load,
    cross_node_bytes,
    cross_node_fraction,
    plan_placement,
    redundant_for,
    to_layout,
)
from relayout.migrate.placement.topology import Topology, TopologyError
from rich.table import Table

# (load, num_devices, node_of, num_slots, expert_groups or None) -> a placement to compare with
Reference = Callable[[list[list[float]], int, list[int], int, int | None], Placement | None]


def plan_main(input_json: dict, reference: Reference | None = None, reference_name: str = "reference") -> dict:
    """{topology, load, needs, concurrency?, latency_target_ms?, measurements?, redundant_slots?,
    coact?, hidden_bytes?, model?, locality_weight?, expert_groups?} -> {placement, layout, devices, reason, ...}
    or {error}; `"invalid_input": true` marks input that breaks a rule (PlanError and the like),
    as opposed to a fleet with no placeable device set."""
    try:
        return _plan(input_json, reference, reference_name)
    except NotPlaceable as e:
        return {"error": e.reason}
    except (PlanError, TopologyError, ValueError, KeyError, TypeError) as e:
        msg = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        return {"error": msg, "invalid_input": True}


def _plan(inp: dict, reference: Reference | None, reference_name: str) -> dict:
    topo_in = inp["topology"]
    topo = Topology.load(topo_in) if isinstance(topo_in, str) else Topology.from_dict(topo_in)
    load = check_load(inp.get("load"))
    weight = inp.get("locality_weight", DEFAULT_LOCALITY_WEIGHT)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= weight <= 1.0:
        raise PlanError(f"locality_weight: must be a number in [0, 1], got {weight!r}")
    nd = inp["needs"]
    needs = ReplicaNeeds(int(nd["devices"]), float(nd.get("memory_gb_per_device", 0)),
                         float(nd.get("min_exchange_gbps", 0)))
    best = find_placeable_sets(topo, needs)[0]
    world = needs.devices
    node_of = [i for i, n in enumerate(best.devices_per_node) for _ in range(n)]
    E = len(load[0])
    redundant = inp.get("redundant_slots", redundant_for(E, world))
    coact = inp.get("coact")
    placement = plan_placement(load, world, max(best.devices_per_node), redundant, coact, node_of=node_of,
                               locality_weight=float(weight))
    if inp.get("measurements") and inp.get("concurrency"):
        ch = choose_attention_split(world, int(inp["concurrency"]), float(inp.get("latency_target_ms", 50.0)),
                                    inp["measurements"])
        dp, tp, attn_reason = ch.attn_dp, ch.attn_tp, ch.reason
    else:
        dp, tp = world, 1
        attn_reason = "no attention measurements given: data parallel attention (attn_dp = world size)"
    cfg = None
    if inp.get("model"):
        from relayout.engine.model.config import ModelConfig
        from relayout.engine.model.weights import resolve_model

        cfg = ModelConfig.from_dir(resolve_model(inp["model"]))
    layout = to_layout(placement, dp, tp, world, 1, cfg=cfg)
    if cfg is not None:
        layout.validate(cfg)
    hb = int(inp.get("hidden_bytes", 1))
    out = {
        "placement": placement.phy2log,
        "num_layers": cfg.num_layers if cfg is not None else None,
        "moe_layers": [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)] if cfg is not None else None,
        "redundant_slots": redundant,
        "layout": layout.to_dict(),
        "layout_str": str(layout),
        "devices": best.devices,
        "nodes": best.nodes,
        "min_bandwidth_gbps": best.min_bandwidth_gbps,
        "locality_weight": float(weight),
        "balance": round(balance(placement, load), 4),
        "cross_node_fraction": round(cross_node_fraction(placement, load, coact), 4),
        "cross_node_bytes": cross_node_bytes(placement, load, None, hb, coact),
    }
    reason = (f"devices: {best.reason}. attention: {attn_reason}. experts: {redundant} redundant slots, "
              f"locality weight {float(weight):g} (0 = balance first, 1 = fewest cross-node copies)")
    groups = inp.get("expert_groups")
    ref = reference(load, world, list(node_of), E + redundant, groups) if reference is not None else None
    if ref is not None:
        out.update(baseline=reference_name, baseline_balance=round(balance(ref, load), 4),
                   baseline_cross_node_fraction=round(cross_node_fraction(ref, load, coact), 4),
                   baseline_cross_node_bytes=cross_node_bytes(ref, load, None, hb, coact))
        reason += (f"; {reference_name}: balance {out['baseline_balance']:.3f}, "
                   f"cross-node {out['baseline_cross_node_fraction']:.3f}")
    out["reason"] = reason
    return out


def sglang_expert_location(result: dict, num_layers: int | None = None, moe_layers: list[int] | None = None) -> dict:
    """A plan as the expert location file SGLang's `--init-expert-location FILE.json` reads
    (`ExpertLocationMetadata.init_by_mapping`): `physical_to_logical_map`, one row per model layer of
    `num_experts + ep_num_redundant_experts` physical slots, slot p on expert-parallel rank
    p // (slots / ep_size) as in relayout's layouts. With the model's layer count, rows go to its MoE
    layers (`moe_layers`) and every other layer gets SGLang's trivial row (slot p -> expert p % E)."""
    rows = [list(r) for r in result["placement"]]
    if not rows:
        raise PlanError("the plan has no placement to export")
    width, E = len(rows[0]), max(max(r) for r in rows) + 1
    if num_layers is not None and num_layers != len(rows):
        moe = moe_layers if moe_layers is not None else list(range(num_layers - len(rows), num_layers))
        if len(moe) != len(rows):
            raise PlanError(f"the plan has {len(rows)} layers; the model has {len(moe)} MoE layers")
        it = iter(rows)
        rows = [next(it) if i in moe else [p % E for p in range(width)] for i in range(num_layers)]
    return {"physical_to_logical_map": rows}


def format_plan_table(result: dict) -> Table:
    if "error" in result:
        t = Table(title="relayout plan: " + ("invalid input" if result.get("invalid_input") else "not placeable"))
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
    if "baseline" in result:
        t.add_row(f"balance (planner / {result['baseline']})",
                  f"{result['balance']:.3f} / {result['baseline_balance']:.3f}")
        t.add_row(f"cross-node fraction (planner / {result['baseline']})",
                  f"{result['cross_node_fraction']:.3f} / {result['baseline_cross_node_fraction']:.3f}")
    else:
        t.add_row("balance", f"{result['balance']:.3f}")
        t.add_row("cross-node fraction", f"{result['cross_node_fraction']:.3f}")
    for i, row in enumerate(result["placement"]):
        t.add_row(f"layer {i} phy2log", " ".join(map(str, row)))
    t.add_row("reason", result["reason"])
    return t
