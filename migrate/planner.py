"""Expert placement planner: redundant experts, balanced devices, little cross-node traffic.

A placement is, per layer, a phy2log row of E + redundant_slots logical expert ids dealt to
`num_devices` equal groups in order (device d holds row[d*spd:(d+1)*spd]), the way
engine.layout.Layout deals slots to expert-parallel ranks.

Cost model (mirrors engine/moe.py):
- an expert's tokens are spread round-robin over its replicas, so each replica carries
  load/replicas; a device's load is the sum over its slots;
- tokens are spread evenly over DP ranks, so a token's source node is uniform; its copy for
  expert e goes to node n with probability f[e,n] = replicas of e on n / replicas of e.
  Summed over sources, that alone makes cross-node bytes (1 - 1/N) * pairs, whatever the
  placement. What placement can change is deduplication: a token whose top-k experts sit
  on the same remote node need cross the network once (node-aware dispatch, as DeepEP does)
  and is then forwarded over NVLink. With co-activation counts C[i,j] (tokens choosing both
  i and j) the expected cross-node copies are (1 - 1/N) * (sum(load) - S) with
  S = sum_{i<j} C[i,j] * sum_n f[i,n] f[j,n]; exact for top-2, second order beyond.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
from relayout.engine.config import ModelConfig
from relayout.engine.layout import Layout
from relayout.migrate.attention_split import AttentionChoice, choose_attention_split, measure_attention_splits
from relayout.migrate.placeable import Candidate, NotPlaceable, ReplicaNeeds, find_placeable_sets

__all__ = [
    "AttentionChoice", "Candidate", "ExpertLoad", "NotPlaceable", "Placement", "PlanError", "ReplicaNeeds",
    "balance", "choose_attention_split", "cross_node_bytes", "eplb_baseline", "find_placeable_sets",
    "measure_attention_splits", "plan_placement", "redundant_for", "to_layout",
]


class PlanError(ValueError):
    pass


@dataclass
class Placement:
    phy2log: list[list[int]]  # per layer, logical expert of each physical slot
    num_devices: int
    node_of: list[int]  # node index of each device
    source: list[str] = field(default_factory=list)  # per layer: "planner" or "baseline"

    @property
    def slots_per_device(self) -> int:
        return len(self.phy2log[0]) // self.num_devices if self.phy2log else 0

    def device_experts(self, layer: int, device: int) -> list[int]:
        s = self.slots_per_device
        return self.phy2log[layer][device * s:(device + 1) * s]


class ExpertLoad:
    """Per-layer per-expert load as an exponential moving average of count snapshots."""

    def __init__(self) -> None:
        self.load: list[list[float]] | None = None
        self.coact: list[np.ndarray] | None = None  # per layer [E, E] co-activation, if known
        self._last_totals: list[list[float]] | None = None

    def update(self, counts: list[list[float]], alpha: float = 0.3,
               coact: list[list[list[float]]] | None = None) -> None:
        """Fold in one window's counts; `alpha` weighs the new window (1.0 = forget the past)."""
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        new = [[float(c) for c in row] for row in counts]
        if self.load is None:
            self.load = new  # first window: nothing to average with
        else:
            if len(new) != len(self.load) or any(len(a) != len(b) for a, b in zip(new, self.load, strict=True)):
                raise ValueError("counts shape changed between snapshots")
            self.load = [[(1 - alpha) * o + alpha * n for o, n in zip(ro, rn, strict=True)]
                         for ro, rn in zip(self.load, new, strict=True)]
        if coact is not None:
            c = [np.asarray(m, dtype=float) for m in coact]
            self.coact = c if self.coact is None else [(1 - alpha) * o + alpha * n for o, n in zip(self.coact, c, strict=True)]

    def update_from_totals(self, totals: list[list[float]], alpha: float = 0.3) -> None:
        """Engine counters (`expert_stats()["expert_counts"]`) are cumulative: fold in the difference."""
        if self._last_totals is None:
            window = totals
        else:
            window = [[t - p for t, p in zip(rt, rp, strict=True)] for rt, rp in zip(totals, self._last_totals, strict=True)]
        self._last_totals = [list(r) for r in totals]
        self.update(window, alpha)


# ---------------------------------------------------------------------------------------------
# metrics

def _node_of(num_devices: int, devices_per_node: int) -> list[int]:
    if devices_per_node < 1 or num_devices % devices_per_node:
        raise PlanError(f"devices_per_node={devices_per_node} does not divide num_devices={num_devices}")
    return [d // devices_per_node for d in range(num_devices)]


def _device_loads(row: list[int], load: np.ndarray, num_devices: int) -> np.ndarray:
    reps = np.bincount(row, minlength=len(load))
    w = load[row] / reps[row]
    return w.reshape(num_devices, -1).sum(axis=1)


def _fracs(row: list[int], num_experts: int, num_devices: int, node_of: list[int]) -> np.ndarray:
    spd = len(row) // num_devices
    nodes = max(node_of) + 1
    f = np.zeros((num_experts, nodes))
    for s, e in enumerate(row):
        f[e, node_of[s // spd]] += 1
    return f / np.maximum(f.sum(axis=1, keepdims=True), 1)


def _layer_cross(row: list[int], load: np.ndarray, coact: np.ndarray | None, num_devices: int,
                 node_of: list[int]) -> float:
    """Expected cross-node token copies of one layer (module docstring)."""
    n = max(node_of) + 1
    if n == 1:
        return 0.0
    s = 0.0
    if coact is not None:
        f = _fracs(row, len(load), num_devices, node_of)
        s = float(np.sum(np.triu(coact, 1) * (f @ f.T)))
    return (1 - 1 / n) * (float(load.sum()) - s)


def balance(placement: Placement, load: list[list[float]]) -> float:
    """Per layer mean/max device load, averaged over layers (1.0 = perfectly balanced)."""
    vals = []
    for row, lr in zip(placement.phy2log, load, strict=True):
        dl = _device_loads(row, np.asarray(lr, dtype=float), placement.num_devices)
        vals.append(float(dl.mean() / dl.max()) if dl.max() > 0 else 1.0)
    return float(np.mean(vals)) if vals else 1.0


def cross_node_bytes(placement: Placement, load: list[list[float]], devices_per_node: int | None = None,
                     hidden_bytes: int = 1, coact: list | None = None) -> float:
    """Bytes the dispatch sends between nodes (one token copy = hidden_bytes), summed over layers."""
    node_of = placement.node_of if devices_per_node is None else _node_of(placement.num_devices, devices_per_node)
    total = 0.0
    for i, (row, lr) in enumerate(zip(placement.phy2log, load, strict=True)):
        c = None if coact is None or coact[i] is None else np.asarray(coact[i], dtype=float)
        total += _layer_cross(row, np.asarray(lr, dtype=float), c, placement.num_devices, node_of)
    return total * hidden_bytes


# ---------------------------------------------------------------------------------------------
# building blocks

def _replicas(load: np.ndarray, num_slots: int, cap: int) -> list[int]:
    """Give each spare slot to the expert with the highest load per replica (at most `cap` each)."""
    reps = [1] * len(load)
    heap = [(-float(w), e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(load)):
        while True:
            _, e = heapq.heappop(heap)
            if reps[e] < cap:
                break
        reps[e] += 1
        heapq.heappush(heap, (-float(load[e]) / reps[e], e))
    return reps


def _pack(items: list[tuple[float, int]], num_devices: int, spd: int) -> list[list[int]]:
    """LPT: heaviest physical expert first onto the least loaded device with a free slot that
    does not hold that expert yet; a swap repairs the rare dead end at the tail."""
    devs: list[list[int]] = [[] for _ in range(num_devices)]
    dload = [0.0] * num_devices
    wt: dict[int, float] = {}
    for w, e in sorted(items, key=lambda t: (-t[0], t[1])):
        wt[e] = w
        ok = [d for d in range(num_devices) if len(devs[d]) < spd and e not in devs[d]]
        if ok:
            d = min(ok, key=lambda d: (dload[d], d))
            devs[d].append(e)
            dload[d] += w
            continue
        # dead end: every device with room holds e; move some expert x from a full device d2
        # (that lacks e) to a device d with room (that lacks x), and put e in its place
        d = next(d for d in range(num_devices) if len(devs[d]) < spd)
        for d2 in range(num_devices):
            if e in devs[d2]:
                continue
            x = next((x for x in devs[d2] if x not in devs[d]), None)
            if x is not None:
                devs[d2][devs[d2].index(x)] = e
                devs[d].append(x)
                dload[d2] += w - wt[x]
                dload[d] += wt[x]
                break
        else:  # pragma: no cover - impossible when replicas <= devices
            raise PlanError("cannot place experts without putting one twice on a device")
    return devs


# ---------------------------------------------------------------------------------------------
# EPLB-style baseline

def _eplb_layer(load: np.ndarray, num_devices: int, dpn: int, redundant: int) -> list[int]:
    E = len(load)
    nodes = num_devices // dpn
    if E % nodes or (E + redundant) % nodes or (E // nodes) * dpn < (E + redundant) // nodes:
        # groups do not split evenly over nodes, or a node cannot fill its slots without putting
        # an expert twice on a device: global policy
        nodes, dpn = 1, num_devices
    per_group = E // nodes
    groups = [list(range(g * per_group, (g + 1) * per_group)) for g in range(nodes)]
    # 1. expert groups to nodes, heaviest group first onto the lightest node (one group each)
    node_groups: list[list[int]] = [[] for _ in range(nodes)]
    nload = [0.0] * nodes
    for g in sorted(range(nodes), key=lambda g: -float(load[groups[g]].sum())):
        n = min((n for n in range(nodes) if not node_groups[n]), key=lambda n: nload[n])
        node_groups[n].append(g)
        nload[n] += float(load[groups[g]].sum())
    row: list[int] = []
    slots_per_node = (E + redundant) // nodes
    spd = slots_per_node // dpn
    for n in range(nodes):
        experts = [e for g in node_groups[n] for e in groups[g]]
        # 2. replicate within the node by load per replica
        reps = _replicas(load[experts], slots_per_node, dpn)
        items = [(float(load[e]) / r, e) for e, r in zip(experts, reps, strict=True) for _ in range(r)]
        # 3. physical experts onto the node's devices, equal slot counts
        for dev in _pack(items, dpn, spd):
            row.extend(dev)
    return row


def eplb_baseline(load: list[list[float]], num_devices: int, devices_per_node: int,
                  redundant_slots: int) -> Placement:
    """DeepSeek EPLB-style hierarchical placement (written from its description)."""
    node_of = _node_of(num_devices, devices_per_node)
    _check(load, num_devices, redundant_slots)
    rows = [_eplb_layer(np.asarray(lr, dtype=float), num_devices, devices_per_node, redundant_slots)
            for lr in load]
    return Placement(rows, num_devices, node_of, ["baseline"] * len(rows))


def redundant_for(experts: int, devices: int) -> int:
    """Default spare slots: one more slot per device than an even split needs."""
    spd = -(-experts // devices) + (1 if experts % devices == 0 else 0)
    return spd * devices - experts


def _check(load: list[list[float]], num_devices: int, redundant: int) -> None:
    if not load or not load[0]:
        raise PlanError("load is empty: need per-layer per-expert counts")
    E = len(load[0])
    if any(len(r) != E for r in load):
        raise PlanError("every layer's load must list the same number of experts")
    if redundant < 0 or (E + redundant) % num_devices:
        raise PlanError(f"{E} experts + {redundant} redundant slots do not split evenly over {num_devices} devices")
    if (E + redundant) // num_devices > E:
        raise PlanError(f"{(E + redundant) // num_devices} slots per device but only {E} experts: "
                        "a device would hold one expert twice")


# ---------------------------------------------------------------------------------------------
# planner: greedy replication + LPT, then local search on (max device load, cross-node copies)

class _Search:
    """Slot swaps between devices. Each accepted swap improves the objective, so it ends."""

    def __init__(self, row: list[int], load: np.ndarray, coact: np.ndarray | None, num_devices: int,
                 node_of: list[int]):
        self.ex = np.array(row)
        self.load, self.D = load, num_devices
        self.spd = len(row) // num_devices
        self.dev = np.arange(len(row)) // self.spd
        self.node = np.asarray(node_of)[self.dev]
        self.reps = np.bincount(self.ex, minlength=len(load)).astype(float)
        self.w = load[self.ex] / self.reps[self.ex]
        self.C = coact
        self.eps = 1e-9 * max(1.0, float(load.sum()))
        self._refresh()

    def _refresh(self) -> None:
        self.L = np.bincount(self.dev, weights=self.w, minlength=self.D)
        pres = np.zeros((self.D, len(self.load)), dtype=bool)
        pres[self.dev, self.ex] = True
        # feasible[a, b]: swapping slots a and b keeps every device free of duplicates
        self.feasible = ~pres[self.dev[None, :], self.ex[:, None]] & ~pres[self.dev[:, None], self.ex[None, :]]
        self.feasible &= self.dev[:, None] != self.dev[None, :]
        if self.C is not None and self.node.max() > 0:
            nodes = int(self.node.max()) + 1
            f = np.zeros((len(self.load), nodes))
            np.add.at(f, (self.ex, self.node), 1.0)
            f /= self.reps[:, None]
            self.G = self.C @ f  # G[x, n]: co-activation mass of x's partners on node n

    def _gain_s(self, rows: np.ndarray | None = None) -> np.ndarray:
        """dS[a, b]: change of the shared-node term S when slots a (in `rows`) and b swap."""
        rows = np.arange(len(self.ex)) if rows is None else rows
        if self.C is None or self.node.max() == 0:
            return np.zeros((len(rows), len(self.ex)))
        x, n, r = self.ex, self.node, self.reps[self.ex]
        xa, na, ra = x[rows], n[rows], r[rows]
        ga = (self.G[xa[:, None], n[None, :]] - self.G[xa, na][:, None]) / ra[:, None]
        gb = (self.G[x[None, :], na[:, None]] - self.G[x, n][None, :]) / r[None, :]
        d = ga + gb - 2 * self.C[xa[:, None], x[None, :]] / (ra[:, None] * r[None, :])
        d[na[:, None] == n[None, :]] = 0.0
        return d

    def _swap(self, a: int, b: int) -> None:
        self.ex[a], self.ex[b] = self.ex[b], self.ex[a]
        self.w[a], self.w[b] = self.w[b], self.w[a]
        self._refresh()

    def balance(self, pareto: bool, max_iter: int = 2000) -> None:
        """Lower the busiest device's load (pareto: never at the cost of cross-node copies)."""
        for _ in range(max_iter):
            top = int(np.argmax(self.L))
            a_idx = np.nonzero(self.dev == top)[0]
            ds = self._gain_s(a_idx)
            new_top = self.L[top] - self.w[a_idx][:, None] + self.w[None, :]
            new_other = self.L[self.dev][None, :] - self.w[None, :] + self.w[a_idx][:, None]
            worst = np.maximum(new_top, new_other)
            ok = self.feasible[a_idx] & (worst < self.L[top] - self.eps)
            if pareto:
                ok &= ds >= -self.eps
            if not ok.any():
                return
            score = np.where(ok, worst - 1e-6 * self.eps * ds, np.inf)
            i, b = np.unravel_index(int(np.argmin(score)), score.shape)
            self._swap(int(a_idx[i]), int(b))

    def localise(self, max_iter: int = 2000) -> None:
        """Raise S (fewer cross-node copies) with swaps that keep the max device load."""
        if self.C is None or self.node.max() == 0:
            return
        for _ in range(max_iter):
            ds = self._gain_s()
            cap = self.L.max() + self.eps
            la = self.L[self.dev][:, None] - self.w[:, None] + self.w[None, :]
            lb = self.L[self.dev][None, :] - self.w[None, :] + self.w[:, None]
            ok = self.feasible & (la <= cap) & (lb <= cap) & (ds > self.eps)
            if not ok.any():
                return
            a, b = np.unravel_index(int(np.argmax(np.where(ok, ds, -np.inf))), ds.shape)
            self._swap(int(a), int(b))

    def row(self) -> list[int]:
        return [int(e) for e in self.ex]


def _score(row: list[int], load: np.ndarray, coact: np.ndarray | None, D: int, node_of: list[int]) -> tuple:
    return float(_device_loads(row, load, D).max()), _layer_cross(row, load, coact, D, node_of)


def plan_placement(load: list[list[float]], num_devices: int, devices_per_node: int, redundant_slots: int,
                   coact: list | None = None, *, node_of: list[int] | None = None) -> Placement:
    """Per layer: minimise the max device load, then the cross-node copies; never worse than EPLB."""
    node_of = node_of or _node_of(num_devices, devices_per_node)
    _check(load, num_devices, redundant_slots)
    counts = {node_of.count(n) for n in set(node_of)}
    # EPLB's hierarchy needs equal nodes; otherwise it runs its global policy
    base = eplb_baseline(load, num_devices, counts.pop() if len(counts) == 1 else num_devices, redundant_slots)
    E = len(load[0])
    spd = (E + redundant_slots) // num_devices
    rows, src = [], []
    for i, lr in enumerate(load):
        lv = np.asarray(lr, dtype=float)
        c = None if coact is None or coact[i] is None else np.asarray(coact[i], dtype=float)
        reps = _replicas(lv, E + redundant_slots, num_devices)
        items = [(float(lv[e]) / r, e) for e, r in enumerate(reps) for _ in range(r)]
        start = [e for dev in _pack(items, num_devices, spd) for e in dev]
        a = _Search(start, lv, c, num_devices, node_of)
        a.balance(pareto=False)
        a.localise()
        a.balance(pareto=True)
        # also polish the baseline without ever trading away either objective
        b = _Search(base.phy2log[i], lv, c, num_devices, node_of)
        b.balance(pareto=True)
        b.localise()
        bs = _score(base.phy2log[i], lv, c, num_devices, node_of)
        eps = 1e-9 * max(1.0, float(lv.sum()))
        # keep the best candidate that is no worse than the baseline on both objectives, so the
        # planner can never lose to EPLB (the polished baseline always qualifies)
        cands = [(s, r, n) for r, n in ((a.row(), "planner"), (b.row(), "planner"), (base.phy2log[i], "baseline"))
                 for s in [_score(r, lv, c, num_devices, node_of)]
                 if s[0] <= bs[0] + eps and s[1] <= bs[1] + eps]
        s, r, n = min(cands, key=lambda t: t[0])
        if n == "planner" and s[0] >= bs[0] - eps and s[1] >= bs[1] - eps:
            n = "baseline"  # no gain: say so
        rows.append(r)
        src.append(n)
    return Placement(rows, num_devices, list(node_of), src)


def to_layout(placement: Placement, attn_dp: int, attn_tp: int, moe_ep: int, moe_tp: int = 1,
              cfg: ModelConfig | None = None) -> Layout:
    """The Layout carrying `placement`. With `cfg`, rows are matched to MoE layers and dense
    layers get identity rows (Layout.placement has one row per model layer)."""
    if moe_ep != placement.num_devices:
        raise PlanError(f"placement is for {placement.num_devices} expert-parallel ranks, moe_ep={moe_ep}")
    rows = [tuple(r) for r in placement.phy2log]
    if cfg is not None and len(rows) != cfg.num_layers:
        moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        if len(rows) != len(moe_layers):
            raise PlanError(f"placement has {len(rows)} layers; the model has {cfg.num_layers} "
                            f"({len(moe_layers)} MoE)")
        it = iter(rows)
        rows = [next(it) if cfg.is_moe_layer(i) else tuple(range(cfg.num_experts)) for i in range(cfg.num_layers)]
    return Layout(attn_dp=attn_dp, attn_tp=attn_tp, moe_ep=moe_ep, moe_tp=moe_tp, placement=tuple(rows))
