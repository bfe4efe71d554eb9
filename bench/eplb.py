"""DeepSeek's EPLB as a yardstick for `relayout bench placement` (never used by the planner).

Written from the algorithm published at github.com/deepseek-ai/EPLB:
- hierarchical policy (when the node count divides the expert-group count): expert groups
  (contiguous id ranges) are packed onto nodes, heaviest first onto the lightest node with room;
  within each node, spare slots go one at a time to the expert with the highest load per copy;
  the copies are then packed onto the node's GPUs the same way, each GPU taking the same count;
- global policy: the same with one group and one node.
Ties break as the published code does (stable descending sort, lowest index wins), so the
README's example mapping comes out exactly (tests/test_planner.py checks it).
"""

from __future__ import annotations

import numpy as np
from relayout.migrate.placement.dispatch_model import Placement, check_load, check_slots

__all__ = ["eplb_placement", "eplb_reference", "rebalance"]


def _pack(weights: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Items to packs of equal item count, heaviest first onto the lightest pack with room.
    Returns (pack of each item, position of the item inside its pack)."""
    n = len(weights)
    per_pack = n // num_packs
    if per_pack == 1:
        return np.arange(n), np.zeros(n, dtype=int)
    pack = np.full(n, -1)
    pos = np.full(n, -1)
    pack_weight = [0.0] * num_packs
    pack_count = [0] * num_packs
    for item in np.argsort(-weights, kind="stable"):
        p = min((q for q in range(num_packs) if pack_count[q] < per_pack), key=pack_weight.__getitem__)
        pack[item], pos[item] = p, pack_count[p]
        pack_weight[p] += float(weights[item])
        pack_count[p] += 1
    return pack, pos


def _replicate(weights: np.ndarray, num_copies: int) -> tuple[list[int], np.ndarray]:
    """Copies of each expert: spare copies one by one to the highest load per copy.
    Returns (expert of each copy, copies per expert); the first len(weights) copies are the originals."""
    count = np.ones(len(weights), dtype=int)
    experts = list(range(len(weights)))
    for _ in range(num_copies - len(weights)):
        e = int(np.argmax(weights / count))
        experts.append(e)
        count[e] += 1
    return experts, count


def _layer(weights: np.ndarray, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int) -> list[int]:
    E = len(weights)
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    # 1. groups onto nodes; node-major order of the experts (node, group rank in node, offset)
    gpack, gpos = _pack(weights.reshape(num_groups, group_size).sum(axis=1), num_nodes)
    node_major = np.empty(E, dtype=int)  # node-major index -> logical expert
    for g in range(num_groups):
        base = (gpack[g] * groups_per_node + gpos[g]) * group_size
        node_major[base:base + group_size] = np.arange(g * group_size, (g + 1) * group_size)
    per_node = E // num_nodes
    slots_per_node = num_slots // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_slots // num_gpus
    row: list[int] = []
    for n in range(num_nodes):
        local = node_major[n * per_node:(n + 1) * per_node]
        w = weights[local]
        # 2. copies within the node
        copy_expert, count = _replicate(w, slots_per_node)
        copy_weight = np.array([w[e] / count[e] for e in copy_expert])
        # 3. copies onto the node's GPUs
        pack, pos = _pack(copy_weight, gpus_per_node)
        node_row = [0] * slots_per_node
        for c, e in enumerate(copy_expert):
            node_row[pack[c] * slots_per_gpu + pos[c]] = int(local[e])
        row.extend(node_row)
    return row


def rebalance(weight: list[list[float]], num_slots: int, num_groups: int, num_nodes: int, num_gpus: int,
              *, policy: str = "auto") -> list[list[int]]:
    """phy2log per layer. policy: "hierarchical", "global", or "auto" (hierarchical when the node
    count divides the group count, as the published entry point chooses)."""
    load = check_load(weight, "weight")
    E = len(load[0])
    check_slots(E, num_slots, num_gpus, "num_slots")
    if policy == "auto":
        policy = "hierarchical" if num_groups % num_nodes == 0 else "global"
    if policy == "global":
        num_groups, num_nodes = 1, 1
    elif policy != "hierarchical":
        raise ValueError(f"policy: one of auto, hierarchical, global; got {policy!r}")
    if E % num_groups or num_groups % num_nodes or num_gpus % num_nodes or num_slots % num_nodes:
        raise ValueError(f"hierarchical EPLB needs groups | experts, nodes | groups and nodes | GPUs "
                         f"(experts={E}, groups={num_groups}, nodes={num_nodes}, GPUs={num_gpus})")
    return [_layer(np.asarray(lr, dtype=float), num_slots, num_groups, num_nodes, num_gpus) for lr in load]


def eplb_placement(load: list[list[float]], num_devices: int, node_of: list[int], num_slots: int,
                   num_groups: int, policy: str) -> Placement:
    """EPLB's placement as a Placement on `node_of` (equal nodes for the hierarchical policy)."""
    nodes = max(node_of) + 1
    rows = rebalance(load, num_slots, num_groups, nodes, num_devices, policy=policy)
    return Placement(rows, num_devices, list(node_of), [f"eplb_{policy}"] * len(rows))


def eplb_reference(load: list[list[float]], num_devices: int, node_of: list[int], num_slots: int,
                   num_groups: int | None = None) -> Placement:
    """EPLB as `relayout plan` compares with: hierarchical when the nodes are equal, contiguous
    and divide the expert groups (default: one group per node), else global."""
    nodes = max(node_of) + 1
    E = len(load[0])
    groups = nodes if num_groups is None else int(num_groups)
    equal = node_of == sorted(node_of) and len(set(node_of.count(n) for n in range(nodes))) == 1
    hier = equal and groups > 0 and E % groups == 0 and groups % nodes == 0 and num_slots % nodes == 0
    return eplb_placement(load, num_devices, node_of, num_slots, groups, "hierarchical" if hier else "global")
