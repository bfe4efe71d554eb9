"""Placeable-set finder: which free devices can carry a replica ("free GPUs are not placeable GPUs").

A replica needs `devices` GPUs with enough memory whose every pair exchanges experts at
>= `min_exchange_gbps`. Pairwise bandwidth is hierarchical (NVLink domain > node PCIe >
network), so instead of trying combinations we build one best set per NVLink domain, per
node and per network tier, and rank them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from relayout.migrate.placement.topology import Device, Topology


@dataclass(frozen=True)
class ReplicaNeeds:
    devices: int
    memory_gb_per_device: float = 0.0
    min_exchange_gbps: float = 0.0


@dataclass
class Candidate:
    devices: list[str]  # grouped by node, nodes in order
    nodes: list[str]
    min_bandwidth_gbps: float  # slowest pair of the set
    devices_per_node: list[int]
    domains: int  # NVLink domains / PCIe islands spanned (compactness)
    reason: str = ""


class NotPlaceable(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _domain(d: Device) -> tuple[str, str]:
    return (d.node, d.nvlink_domain if d.nvlink_domain is not None else f"pcie:{d.id}")


def _pick(devs: list[Device], k: int) -> list[Device]:
    """k devices of one node, from the fullest NVLink domain (then PCIe switch) down."""
    by_dom: dict[tuple, list[Device]] = defaultdict(list)
    for d in devs:
        by_dom[_domain(d)].append(d)
    out: list[Device] = []
    for dom in sorted(by_dom.values(), key=lambda v: (-len(v), v[0].id)):
        by_sw: dict[str, list[Device]] = defaultdict(list)
        for d in dom:
            by_sw[d.pcie_switch or ""].append(d)
        for sw in sorted(by_sw.values(), key=lambda v: (-len(v), v[0].id)):
            out.extend(sorted(sw, key=lambda d: d.index)[: k - len(out)])
            if len(out) == k:
                return out
    return out


def _candidate(topo: Topology, chosen: list[Device]) -> Candidate:
    nodes = list(dict.fromkeys(d.node for d in chosen))
    chosen = sorted(chosen, key=lambda d: (nodes.index(d.node), d.index))
    bw = min((topo.bandwidth(a, b) for i, a in enumerate(chosen) for b in chosen[i + 1:]), default=float("inf"))
    return Candidate([d.id for d in chosen], nodes, bw, [sum(d.node == n for d in chosen) for n in nodes],
                     len({_domain(d) for d in chosen}))


def _all_candidates(topo: Topology, eligible: list[Device], k: int) -> list[Candidate]:
    by_node: dict[str, list[Device]] = defaultdict(list)
    for d in eligible:
        by_node[d.node].append(d)
    cands: list[Candidate] = []
    # one node (_pick fills from one NVLink domain when it can)
    for devs in by_node.values():
        if len(devs) >= k:
            cands.append(_candidate(topo, _pick(devs, k)))
    # several nodes: for each network tier, the fewest nodes of that tier or better; an equal
    # share per node when possible (the planner's model wants equal nodes)
    for tier in sorted({topo.node(n).network_gbps for n in by_node}, reverse=True):
        nodes = sorted((n for n in by_node if topo.node(n).network_gbps >= tier), key=lambda n: -len(by_node[n]))
        if sum(len(by_node[n]) for n in nodes) < k:
            continue
        for m in range(2, len(nodes) + 1):
            if k % m == 0 and sum(len(by_node[n]) >= k // m for n in nodes) >= m:
                use = sorted((n for n in nodes if len(by_node[n]) >= k // m), key=lambda n: len(by_node[n]))[:m]
                cands.append(_candidate(topo, [d for n in use for d in _pick(by_node[n], k // m)]))
                break
        chosen: list[Device] = []
        for n in nodes:  # uneven fill, fullest nodes first
            chosen += _pick(by_node[n], min(len(by_node[n]), k - len(chosen)))
            if len(chosen) == k:
                cands.append(_candidate(topo, chosen))
                break
    uniq = {tuple(c.devices): c for c in cands}
    return list(uniq.values())


def _rank_key(c: Candidate, spare: dict[str, int]) -> tuple:
    # best first: fastest slowest-pair, fewest nodes, fewest domains, least left-over free devices
    # on the nodes used (best fit keeps big contiguous sets for later), then names
    left = sum(spare[n] for n in c.nodes) - len(c.devices)
    return (-c.min_bandwidth_gbps, len(c.nodes), c.domains, left, c.devices)


def find_placeable_sets(topology: Topology, needs: ReplicaNeeds) -> list[Candidate]:
    """Device sets that can carry the replica, best first; raises NotPlaceable saying why not."""
    k = needs.devices
    if k < 1:
        raise NotPlaceable("a replica needs at least one device")
    free = [d for d in topology.devices() if d.free]
    eligible = [d for d in free if d.memory_gb >= needs.memory_gb_per_device]
    if len(eligible) < k:
        small = len(free) - len(eligible)
        extra = f" ({small} more are free but have less memory)" if small else ""
        raise NotPlaceable(f"need {k} free GPUs with >= {needs.memory_gb_per_device:g} GB each; only "
                           f"{len(eligible)} qualify{extra}")
    spare: dict[str, int] = defaultdict(int)
    for d in eligible:
        spare[d.node] += 1
    cands = _all_candidates(topology, eligible, k)
    good = sorted((c for c in cands if c.min_bandwidth_gbps >= needs.min_exchange_gbps),
                  key=lambda c: _rank_key(c, spare))
    if good:
        for c in good:
            where = c.nodes[0] if len(c.nodes) == 1 else ",".join(c.nodes)
            c.reason = (f"{k} GPUs on {where}, slowest pair {c.min_bandwidth_gbps:g} GB/s "
                        f">= {needs.min_exchange_gbps:g} GB/s needed")
        return good
    best = max(cands, key=lambda c: c.min_bandwidth_gbps)
    per_dom: dict[tuple, int] = defaultdict(int)
    for d in eligible:
        per_dom[_domain(d)] += 1
    nodes = sorted(spare)
    if len(best.nodes) > 1:
        where = (f"the free GPUs are scattered across nodes {','.join(nodes)} (at most {max(spare.values())} on "
                 f"one node) connected at {best.min_bandwidth_gbps:g} GB/s")
    else:
        where = (f"the best set, on node {best.nodes[0]}, spans NVLink domains (at most {max(per_dom.values())} "
                 f"free in one) and its slowest pair crosses PCIe at {best.min_bandwidth_gbps:g} GB/s")
    raise NotPlaceable(f"{len(eligible)} free GPUs but no set of {k} whose pairwise bandwidth >= "
                       f"{needs.min_exchange_gbps:g} GB/s: {where}")
