"""Layout planner: placement vs DeepSeek EPLB, bad input, placeable sets, attention split, plan CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from relayout.bench.eplb import eplb_reference, rebalance
from relayout.bench.placement import TOPOLOGIES, default_traces, evaluate
from relayout.engine.model.config import ModelConfig
from relayout.migrate.placement.placeable import NotPlaceable, ReplicaNeeds, find_placeable_sets
from relayout.migrate.placement.plan_cli import format_plan_table, plan_main
from relayout.migrate.placement.planner import (
    ExpertLoad,
    Placement,
    PlanError,
    balance,
    choose_attention_split,
    cross_node_fraction,
    plan_placement,
    redundant_for,
    to_layout,
)
from relayout.migrate.placement.topology import Device, Node, Topology, TopologyError


def _cfg(experts: int, layers: int, dense: tuple[int, ...] = ()) -> ModelConfig:
    return ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=260, hidden_size=64, num_layers=layers,
                       num_heads=16, num_kv_heads=16, head_dim=4, num_experts=experts, top_k=2,
                       moe_intermediate_size=32, dense_intermediate_size=64, norm_topk_prob=True, rms_norm_eps=1e-6,
                       rope_theta=1e4, max_position_embeddings=4096, tie_word_embeddings=False, qk_norm=True,
                       dense_layers=dense)


BENCH_TOPOLOGIES = ("2x8", "1x8")  # the 2 nodes x 8 GPUs, and one node (no network)


@pytest.fixture(scope="module")
def bench_results():
    return [(tr, topo, evaluate(tr, topo)) for tr in default_traces(include_engine=True) for topo in BENCH_TOPOLOGIES]


# ---- DeepSeek's EPLB, the yardstick -----------------------------------------------------------

EPLB_README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                      [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]


def test_eplb_reproduces_the_published_example():
    # github.com/deepseek-ai/EPLB README: 16 slots, 4 groups, 2 nodes, 8 GPUs (hierarchical policy)
    assert rebalance(EPLB_README_WEIGHT, 16, 4, 2, 8) == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    # 3 groups over 2 nodes: the entry point falls back to the global policy
    assert rebalance(EPLB_README_WEIGHT, 16, 3, 2, 8) == rebalance(EPLB_README_WEIGHT, 16, 1, 1, 8, policy="global")
    # the hierarchical policy keeps every expert group on one node
    for row in rebalance(EPLB_README_WEIGHT, 16, 4, 2, 8):
        assert {e // 3 for e in row[:8]}.isdisjoint({e // 3 for e in row[8:]})


def test_planner_meets_the_goal_against_eplb_on_bench_traces(bench_results):
    """Balance >= EPLB-global's and cross-node copies <= 0.8 x EPLB-hierarchical's, both scored by
    the same locality-first dispatch model; never worse than EPLB-hierarchical on either."""
    names = {tr.name for tr, _, _ in bench_results}
    assert {"zipf0.6", "zipf1.1", "zipf1.6", "bursty", "engine-tiny"} <= names
    for tr, topo, r in bench_results:
        p, h, g = r["planner"], r["eplb_hierarchical"], r["eplb_global"]
        assert r["baseline"] is h  # the old key, kept for compatibility
        assert p["balance"] >= h["balance"] - 1e-9 and p["balance"] >= g["balance"] - 1e-9, (tr.name, topo)
        assert p["worst_layer_balance"] >= g["worst_layer_balance"] - 1e-9, (tr.name, topo)
        if TOPOLOGIES[topo][0] == 1:
            assert p["cross_node_bytes"] == h["cross_node_bytes"] == g["cross_node_bytes"] == 0
            continue
        assert p["cross_node_fraction"] <= h["cross_node_fraction"], (tr.name, topo)
        if tr.name != "engine-tiny":  # the four 64-expert traces: the goal, as a ratio
            assert p["cross_node_fraction"] <= 0.8 * h["cross_node_fraction"], (tr.name, topo)
            assert p["cross_node_bytes"] < h["cross_node_bytes"] and p["plan_ms"] > 0


def test_bench_placements_are_valid_layouts(bench_results):
    for tr, topo, r in bench_results:
        nodes, dpn = TOPOLOGIES[topo]
        cfg = _cfg(len(tr.load[0]), len(tr.load))
        to_layout(r["planner"]["placement"], nodes * dpn, 1, nodes * dpn, 1).validate(cfg)
        # EPLB's packing may put two copies of one expert on a GPU (the engine refuses that), but
        # every expert has a slot
        for key in ("eplb_hierarchical", "eplb_global"):
            assert all(set(row) == set(range(cfg.num_experts)) for row in r[key]["placement"].phy2log)


def test_cross_node_traffic_depends_on_placement():
    """Same load, same copy counts, one GPU per node: an expert copied onto both nodes stops crossing."""
    load = [[8.0, 4.0, 2.0, 2.0]]
    both = Placement([[0, 1, 2, 0, 3, 1]], 2, [0, 1])  # 0 and 1 on both nodes: half of 2's and 3's cross
    assert cross_node_fraction(both, load) == pytest.approx((2.0 + 2.0) * 0.5 / 16)
    assert balance(both, load) == pytest.approx(1.0)
    alone = Placement([[0, 1, 2, 3, 1, 2]], 2, [0, 1])  # 0 only on node 0: half its tokens cross
    assert cross_node_fraction(alone, load) == pytest.approx((8.0 + 2.0) * 0.5 / 16)
    assert balance(alone, load) < 0.8  # node 0 serves all of expert 0
    assert balance(alone, load, "spread") == pytest.approx(8 / 11)
    # co-activation: two tokens picked both 2 and 3; on one remote node they cross once, not twice
    coact = [[[0.0] * 4, [0.0] * 4, [0.0, 0.0, 0.0, 2.0], [0.0, 0.0, 2.0, 0.0]]]
    together = Placement([[0, 1, 2, 3]], 2, [0, 1])
    apart = Placement([[0, 2, 1, 3]], 2, [0, 1])
    assert cross_node_fraction(together, load) == cross_node_fraction(apart, load) == pytest.approx(0.5)
    assert cross_node_fraction(together, load, coact) == pytest.approx(7 / 16)  # the node-0 token saves one
    assert cross_node_fraction(apart, load, coact) == pytest.approx(0.5)


def test_locality_weight_trades_balance_for_cross_node_traffic():
    # 2 nodes x 2 GPUs, 4 spare slots: the hot expert wants a copy on every GPU for balance; the
    # four warm ones want a copy on the other node for locality. Spare slots cannot buy both.
    load = [[100.0, 10.0, 10.0, 10.0, 10.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0]]
    lo = plan_placement(load, 4, 2, 4, locality_weight=0.0)
    hi = plan_placement(load, 4, 2, 4, locality_weight=1.0)
    assert lo.phy2log[0].count(0) == 4 and balance(lo, load) > 0.9
    assert cross_node_fraction(hi, load) < 0.6 * cross_node_fraction(lo, load)
    assert balance(hi, load) < 0.8 * balance(lo, load)


def test_to_layout_fills_dense_layers_with_identity_rows():
    load = [[5, 1, 1, 1, 9, 1, 1, 1]] * 2
    p = plan_placement(load, 4, 2, 4)
    cfg = _cfg(8, 3, dense=(0,))
    lay = to_layout(p, 2, 2, 4, 1, cfg=cfg).validate(cfg)
    assert lay.placement[0] == tuple(range(8)) and lay.placement[1] == tuple(p.phy2log[0])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_loads_give_valid_placements(data):
    E = data.draw(st.integers(2, 16))
    D = data.draw(st.sampled_from([1, 2, 4, 8]))
    dpn = data.draw(st.sampled_from([d for d in (1, 2, 4) if D % d == 0]))
    spd = data.draw(st.integers(max(1, -(-E // D)), E))
    layers = data.draw(st.integers(1, 3))
    load = [data.draw(st.lists(st.floats(0, 1e4), min_size=E, max_size=E)) for _ in range(layers)]
    p = plan_placement(load, D, dpn, spd * D - E)
    for row in p.phy2log:
        assert sorted(set(row)) == list(range(E)) and len(row) == spd * D
        for d in range(D):
            mine = row[d * spd:(d + 1) * spd]
            assert len(set(mine)) == len(mine)


def test_plan_refuses_impossible_slot_counts():
    with pytest.raises(PlanError, match="split evenly"):
        plan_placement([[1.0] * 8], 3, 1, 0)


@pytest.mark.parametrize("load, devices, redundant, match", [
    ([[1.0, float("nan"), 2.0, 3.0]], 2, 0, r"load\[0\]\[1\]: must be finite, got nan"),
    ([[1.0, 2.0, float("inf"), 3.0]], 2, 0, r"load\[0\]\[2\]: must be finite, got inf"),
    ([[1.0, 2.0, 3.0, -1.0]], 2, 0, r"load\[0\]\[3\]: must be >= 0, got -1"),
    ([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0]], 2, 0, r"load\[1\]: has 2 experts, load\[0\] has 4; every layer"),
    ([], 2, 0, r"load: must list at least one layer"),
    ([[1.0] * 4, []], 2, 0, r"load\[1\]: must list at least one expert"),
    ([[1.0, "x", 2.0, 3.0]], 2, 0, r"load\[0\]\[1\]: must be a number"),
    ([[1.0] * 64], 16, -16, r"redundant_slots: 48 slots for 64 experts; slots must be >= experts"),
    ([[1.0] * 8], 4, 2, r"redundant_slots: 10 slots do not split evenly over 4 devices; slots must be a multiple"),
    ([[1.0] * 4], 2, 6, r"redundant_slots: 5 slots per device but only 4 experts"),
])
def test_bad_input_is_a_plan_error_naming_field_and_rule(load, devices, redundant, match):
    with pytest.raises(PlanError, match=match):
        plan_placement(load, devices, devices, redundant)
    with pytest.raises(PlanError, match="locality_weight: must be in"):
        plan_placement([[1.0] * 4], 2, 2, 0, locality_weight=1.5)


# ---- placeable sets ---------------------------------------------------------------------------

def _fleet(free_per_node: list[int], gpus: int = 8, network: float = 25.0) -> Topology:
    return Topology(nodes=[
        Node(name=f"n{i + 1}", nvlink_domain_gbps=450, network_gbps=network,
             devices=[Device(id=f"n{i + 1}/gpu{j}", memory_gb=80, free=j < f) for j in range(gpus)])
        for i, f in enumerate(free_per_node)])


def test_finder_refuses_scattered_free_gpus_with_reason():
    with pytest.raises(NotPlaceable) as ei:
        find_placeable_sets(_fleet([2, 2, 2]), ReplicaNeeds(4, 40, 100))
    r = ei.value.reason
    assert "6 free GPUs" in r and "no set of 4" in r and "n1,n2,n3" in r and "25 GB/s" in r


def test_finder_picks_contiguous_set_and_ranks():
    cands = find_placeable_sets(_fleet([2, 4, 8]), ReplicaNeeds(4, 40, 100))
    best = cands[0]
    assert best.nodes == ["n2"] and best.min_bandwidth_gbps == 450  # best fit: the node with 4 free
    assert all(c.min_bandwidth_gbps >= 100 for c in cands) and {tuple(c.nodes) for c in cands} == {("n2",), ("n3",)}
    # a slow network is fine when the replica asks for little
    multi = find_placeable_sets(_fleet([2, 2, 2]), ReplicaNeeds(4, 40, 10))
    assert multi[0].devices_per_node == [2, 2] and multi[0].min_bandwidth_gbps == 25


def test_finder_memory_and_pcie_reasons():
    with pytest.raises(NotPlaceable, match="only 0 qualify"):
        find_placeable_sets(_fleet([4]), ReplicaNeeds(4, 100, 0))
    topo = Topology(nodes=[Node(name="a", nvlink_domain_gbps=300, network_gbps=25, devices=[
        Device(id=f"a{j}", memory_gb=80, nvlink_domain=f"d{j // 2}") for j in range(4)])])
    assert topo.bandwidth("a0", "a1") == 300 and topo.bandwidth("a0", "a2") == 25.0
    with pytest.raises(NotPlaceable, match="PCIe"):
        find_placeable_sets(topo, ReplicaNeeds(4, 40, 100))


def test_finder_scales_to_large_fleet():
    cands = find_placeable_sets(_fleet([3, 5, 1, 7, 8, 2, 6, 4] * 8, network=50), ReplicaNeeds(8, 40, 100))
    assert cands[0].min_bandwidth_gbps == 450 and len(cands[0].nodes) == 1


def test_topology_load_yaml_json_and_errors(tmp_path):
    data = {"nodes": [{"name": "n1", "nvlink_domain_gbps": 450, "network_gbps": 50,
                       "devices": [{"id": "g0", "memory_gb": 80}, {"id": "g1", "memory_gb": 80, "free": False}]}]}
    (tmp_path / "t.json").write_text(json.dumps(data))
    (tmp_path / "t.yaml").write_text("nodes:\n  - name: n1\n    network_gbps: 50\n    devices:\n"
                                     "      - {id: g0, memory_gb: 80}\n")
    assert Topology.load(tmp_path / "t.json").device("g1").node == "n1"
    assert Topology.load(tmp_path / "t.yaml").bandwidth("g0", "g0") == float("inf")
    (tmp_path / "bad.yaml").write_text("nodes:\n  - name: n1\n    devices: []\n")
    with pytest.raises(TopologyError, match="network_gbps"):
        Topology.load(tmp_path / "bad.yaml")


# ---- attention split, load tracking, plan CLI -------------------------------------------------

MEAS = {
    "attn_dp=1,attn_tp=4": {1: 5.0, 8: 7.0, 64: 60.0},
    "attn_dp=4,attn_tp=1": {1: 12.0, 8: 13.0, 64: 20.0},
    "attn_dp=2,attn_tp=2": {1: 8.0, 8: 10.0, 64: 35.0},
    "attn_dp=8,attn_tp=1": {1: 1.0},  # other world size: ignored
}


def test_attention_split_dp_at_high_tp_at_low_concurrency():
    hi = choose_attention_split(4, 64, 30, MEAS)
    assert (hi.attn_dp, hi.attn_tp) == (4, 1) and hi.meets_target
    lo = choose_attention_split(4, 1, 10, MEAS)
    assert (lo.attn_dp, lo.attn_tp) == (1, 4) and "meets" in lo.reason
    none = choose_attention_split(4, 64, 5, MEAS)
    assert (none.attn_dp, none.attn_tp) == (4, 1) and "no split meets" in none.reason


def test_expert_load_ema():
    el = ExpertLoad()
    el.update_from_totals([[10, 0]], alpha=0.5)
    el.update_from_totals([[10, 20]], alpha=0.5)  # window: [0, 20]
    assert el.load == [[5.0, 10.0]]


def test_plan_main_and_table():
    topo = _fleet([2, 4]).model_dump()
    res = plan_main({"topology": topo, "load": [[9, 1, 1, 1, 1, 1, 1, 5]] * 2,
                     "needs": {"devices": 4, "memory_gb_per_device": 40, "min_exchange_gbps": 100},
                     "concurrency": 64, "latency_target_ms": 30, "measurements": MEAS},
                    reference=eplb_reference, reference_name="DeepSeek EPLB")
    assert "error" not in res, res
    assert res["devices"] == [f"n2/gpu{j}" for j in range(4)] and res["layout"]["attn_dp"] == 4
    assert res["balance"] >= res["baseline_balance"] and "EPLB" in res["reason"]
    assert format_plan_table(res).row_count > 3
    bad = plan_main({"topology": _fleet([2, 2, 2]).model_dump(), "load": [[1] * 8],
                     "needs": {"devices": 4, "min_exchange_gbps": 100}})
    assert "no set of 4" in bad["error"] and "25 GB/s" in bad["error"]
    assert format_plan_table(bad).row_count == 1
    assert redundant_for(8, 4) == 4


def test_plan_cli_exits_2_naming_the_bad_field(tmp_path):
    from relayout.agent.cli import app
    from typer.testing import CliRunner

    topo = _fleet([4]).model_dump()
    for load, match in (([[1.0, -2.0, 1.0, 1.0]], "load[0][1]: must be >= 0"),
                        ([[1.0, 2.0], [1.0]], "load[1]: has 1 experts"),
                        ([[1.0] * 8], "redundant_slots: 6 slots for 8 experts")):
        inp = {"topology": topo, "load": load, "needs": {"devices": 2}}
        if len(load[0]) == 8:
            inp["redundant_slots"] = -2
        r = CliRunner().invoke(app, ["plan", "-"], input=json.dumps(inp))
        assert r.exit_code == 2 and match in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(app, ["plan", "-", "--locality-weight", "2"], input="{}")
    assert r.exit_code == 2
    inp = {"topology": topo, "load": [[9, 1, 1, 1, 1, 1, 1, 5]], "needs": {"devices": 4}}
    r = CliRunner().invoke(app, ["plan", "-", "--json", "--locality-weight", "0.7"], input=json.dumps(inp))
    assert r.exit_code == 0, r.output
    res = json.loads(r.output.strip().splitlines()[-1])
    assert res["locality_weight"] == 0.7 and res["baseline"] == "DeepSeek EPLB"
    assert "--locality-weight" in CliRunner().invoke(app, ["plan", "--help"]).output


@pytest.mark.parametrize("kind,s", [("zipf", 0.6), ("zipf", 1.1), ("zipf", 1.6), ("gamma", 0.4)])
def test_relayout_plan_beats_both_eplb_policies_on_plain_traces(kind, s):
    """What the issue measured through `relayout plan` (default settings, 2 nodes x 8 GPUs, counts
    without co-activation): balance >= EPLB-global's at cross-node <= 0.8 x EPLB-hierarchical's."""
    import numpy as np
    from relayout.bench.eplb import eplb_placement
    from relayout.migrate.placement.planner import balance as bal

    rng = np.random.default_rng(int(s * 10))
    load = []
    for _ in range(4):
        pop = rng.gamma(s, 1.0, 64) if kind == "gamma" else 1.0 / np.arange(1, 65)[rng.permutation(64)] ** s
        load.append(rng.multinomial(20_000, pop / pop.sum()).astype(float).tolist())
    res = plan_main({"topology": _fleet([8, 8]).model_dump(), "load": load, "needs": {"devices": 16}},
                    reference=eplb_reference, reference_name="DeepSeek EPLB")
    assert "error" not in res, res
    node_of = [d // 8 for d in range(16)]
    glob = eplb_placement(load, 16, node_of, len(res["placement"][0]), 8, "global")
    assert res["baseline_cross_node_fraction"] > 0  # the reference is hierarchical EPLB on these equal nodes
    assert res["balance"] >= round(bal(glob, load), 4) and res["balance"] >= res["baseline_balance"], res["reason"]
    assert res["cross_node_fraction"] <= 0.8 * res["baseline_cross_node_fraction"], res["reason"]


def test_plan_exports_sglang_expert_locations_that_read_back_with_the_same_structure(tmp_path):
    """`relayout plan --format sglang --out FILE`: the JSON SGLang's `--init-expert-location` reads
    (ExpertLocationMetadata.init_by_mapping: `physical_to_logical_map`, one row per model layer of
    E + redundant slots dealt to ep ranks in order), read back here as SGLang does (json, then each
    logical expert's physical copies)."""
    from relayout.agent.cli import app
    from typer.testing import CliRunner

    out = tmp_path / "expert-location.json"
    load = [[9, 1, 1, 1, 1, 1, 1, 5], [1, 1, 7, 1, 3, 1, 1, 1]]
    inp = {"topology": _fleet([4]).model_dump(), "load": load, "needs": {"devices": 4}}
    r = CliRunner().invoke(app, ["plan", "-", "--json", "--format", "sglang", "--out", str(out)],
                           input=json.dumps(inp))
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output.strip().splitlines()[-1])
    doc = json.loads(out.read_text())
    assert list(doc) == ["physical_to_logical_map"]
    p2l = doc["physical_to_logical_map"]
    assert p2l == plan["placement"] and len(p2l) == 2
    for row in p2l:  # SGLang's rules: E + redundant slots, divisible by ep_size, every expert placed
        assert len(row) == 8 + plan["redundant_slots"] and len(row) % 4 == 0
        l2p = {e: [p for p, x in enumerate(row) if x == e] for e in range(8)}
        assert all(l2p[e] for e in range(8)) and set(row) == set(range(8))
    assert "--ep-num-redundant-experts" in r.output
    from relayout.migrate.placement.plan_cli import sglang_expert_location

    full = sglang_expert_location(plan, num_layers=4, moe_layers=[1, 3])  # dense layers: SGLang's trivial rows
    rows = full["physical_to_logical_map"]
    assert rows[1] == p2l[0] and rows[3] == p2l[1] and rows[0] == [p % 8 for p in range(len(p2l[0]))]
    r = CliRunner().invoke(app, ["plan", "-", "--format", "sglang"], input=json.dumps(inp))
    assert r.exit_code == 2 and "--out" in r.output
