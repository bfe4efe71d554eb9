"""Expert placement planner: redundant experts, balanced devices, little cross-node traffic.

Placements are scored with migrate.placement.dispatch_model (locality-first dispatch: a token uses a copy on
its own device, else on its own node, and crosses the network only when its node has none). Per
layer the planner minimises

    (1 - w) * (max device load / mean - 1)  +  w * cross-node copies / routed copies

with w = `locality_weight`. Both terms come from the same dispatch rule. The trade-off is real
only when spare slots are scarce: a spare slot either deepens a hot expert (its copies carry less
each: balance) or gives a lighter expert a copy on another node (its tokens stop crossing:
locality). w = 0 asks for the best balance (cross-node copies break ties); w = 1 for the fewest
cross-node copies at any balance.

Steps per layer: copies per expert by water-filling (each spare slot to the highest load per
copy), copies spread over nodes in proportion to node size, LPT packing onto each node's devices
(no device holds one expert twice), then a local search over slot swaps and copy reassignments,
each candidate scored exactly by the dispatch model.
"""

from __future__ import annotations

import heapq

import numpy as np
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.layout import Layout
from relayout.migrate.placement.attention_split import (
    AttentionChoice,
    choose_attention_split,
    measure_attention_splits,
)
from relayout.migrate.placement.dispatch_model import (
    Placement,
    PlanError,
    balance,
    check_coact,
    check_load,
    check_slots,
    cross_node_bytes,
    cross_node_fraction,
    layer_dispatch,
    worst_layer_balance,
)
from relayout.migrate.placement.placeable import Candidate, NotPlaceable, ReplicaNeeds, find_placeable_sets

__all__ = [
    "DEFAULT_LOCALITY_WEIGHT", "AttentionChoice", "Candidate", "ExpertLoad", "NotPlaceable", "Placement",
    "PlanError", "ReplicaNeeds", "balance", "check_load", "choose_attention_split", "cross_node_bytes", "cross_node_fraction",
    "find_placeable_sets", "measure_attention_splits", "plan_placement", "redundant_for", "to_layout",
    "worst_layer_balance",
]

DEFAULT_LOCALITY_WEIGHT = 0.1


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




def redundant_for(experts: int, devices: int) -> int:
    """Default spare slots: one more slot per device than an even split needs."""
    spd = -(-experts // devices) + (1 if experts % devices == 0 else 0)
    return spd * devices - experts


# ---------------------------------------------------------------------------------------------
# construction

def _copies(load: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """Copies per expert: each spare slot to the expert with the highest load per copy (<= cap each)."""
    reps = np.ones(len(load), dtype=int)
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


def _spread(load: np.ndarray, reps: np.ndarray, dpn: np.ndarray, spd: int) -> np.ndarray:
    """Copies per (expert, node): heaviest expert first; its copies in proportion to node size,
    the rest on the least loaded nodes with room. Returns c[e, n]."""
    E, N = len(load), len(dpn)
    frac = dpn / dpn.sum()
    room = dpn * spd
    nload = np.zeros(N)
    c = np.zeros((E, N), dtype=int)
    for e in np.argsort(-load, kind="stable"):
        r = int(reps[e])
        want = np.minimum(np.floor(r * frac).astype(int), np.minimum(dpn, room))
        for _ in range(r - int(want.sum())):
            ok = [n for n in range(N) if want[n] < min(dpn[n], room[n])]
            # a node without a copy first (locality), then the least loaded per device
            n = min(ok, key=lambda n: (want[n] > 0, (nload[n] + load[e] / r) / dpn[n], n))
            want[n] += 1
        c[e] = want
        room -= want
        nload += load[e] * want / r
    return c


def _pack(items: list[tuple[float, int]], num_devices: int, spd: int) -> list[list[int]]:
    """LPT: heaviest copy first onto the least loaded device with a free slot that does not hold
    that expert yet; a swap repairs the rare dead end at the tail."""
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
        else:  # pragma: no cover - impossible when copies per node <= devices per node
            raise PlanError("cannot place experts without putting one twice on a device")
    return devs


def _construct(load: np.ndarray, num_devices: int, node_of: np.ndarray, spd: int, cap: int) -> np.ndarray:
    N = int(node_of.max()) + 1
    dpn = np.bincount(node_of, minlength=N)
    reps = _copies(load, spd * num_devices, cap)
    c = _spread(load, reps, dpn, spd)
    row = np.empty(spd * num_devices, dtype=int)
    for n in range(N):
        # copy weight under locality-first dispatch: own node's tokens over own copies, plus a
        # share of the tokens of nodes without a copy
        items = []
        for e in np.nonzero(c[:, n])[0]:
            lacking = float(dpn[c[e] == 0].sum())
            w = load[e] * (dpn[n] / c[e, n] + lacking / reps[e]) / num_devices
            items += [(float(w), int(e))] * int(c[e, n])
        devices = np.nonzero(node_of == n)[0]
        for d, held in zip(devices, _pack(items, len(devices), spd), strict=True):
            row[d * spd:(d + 1) * spd] = held
    return row


# ---------------------------------------------------------------------------------------------
# local search

class _Search:
    """Slot swaps and copy reassignments, candidates pre-ranked by a cheap estimate and scored
    exactly; each accepted move lowers the objective, so it ends."""

    def __init__(self, row: np.ndarray, load: np.ndarray, coact: np.ndarray | None, num_devices: int,
                 node_of: np.ndarray, weight: float):
        self.load, self.C, self.D, self.node_of, self.w = load, coact, num_devices, node_of, weight
        self.total = float(load.sum())
        self.spd = len(row) // num_devices
        self.dev = np.arange(len(row)) // self.spd
        self.node = node_of[self.dev]
        self.N = int(node_of.max()) + 1
        self.frac = np.bincount(node_of, minlength=self.N) / num_devices
        self._set(np.array(row))

    def score(self, row: np.ndarray) -> tuple[float, np.ndarray, float]:
        dl, cross = layer_dispatch(row, self.load, self.D, self.node_of, self.C)
        mean = self.total / self.D
        if mean <= 0:
            return 0.0, dl, cross
        # the max sets the step time; the sum of squares breaks its plateaus
        imbalance = dl.max() / mean - 1 + 1e-3 * float(((dl / mean - 1) ** 2).mean())
        return (1 - self.w) * imbalance + self.w * cross / self.total, dl, cross

    def _set(self, row: np.ndarray) -> None:
        self.row = row
        self.J, self.dl, self.cross = self.score(row)
        E = len(self.load)
        self.K = np.bincount(self.dev * E + row, minlength=self.D * E).reshape(self.D, E)
        self.KN = np.zeros((self.N, E), dtype=int)
        np.add.at(self.KN, self.node_of, self.K)
        self.T = self.K.sum(axis=0)

    def _swaps(self, a_idx: np.ndarray) -> np.ndarray:
        """Feasible swap partners: [len(a_idx), slots], different devices, no duplicate after."""
        x, y = self.row[a_idx], self.row
        da, db = self.dev[a_idx], self.dev
        ok = (da[:, None] != db[None, :]) & (self.K[db[None, :], x[:, None]] == 0) & (self.K[da[:, None], y[None, :]] == 0)
        return ok

    def _candidates(self, k: int) -> list[tuple[str, int, int]]:
        slot_w = self.load[self.row] / self.T[self.row]  # round-robin copy weight: a cheap estimate
        top = int(np.argmax(self.dl))
        others = np.sort(self.dl)[::-1]
        rest = others[1] if len(others) > 1 else 0.0
        a_idx = np.nonzero(self.dev == top)[0]
        out: list[tuple[str, int, int]] = []
        # balance: swap a slot of the busiest device with a lighter copy elsewhere
        ok = self._swaps(a_idx)
        new_top = self.dl[top] - slot_w[a_idx][:, None] + slot_w[None, :]
        new_b = self.dl[self.dev][None, :] - slot_w[None, :] + slot_w[a_idx][:, None]
        est = np.where(ok, np.maximum(np.maximum(new_top, new_b), rest), np.inf)
        for f in np.argsort(est, axis=None)[:k]:
            i, b = np.unravel_index(f, est.shape)
            if np.isfinite(est[i, b]):
                out.append(("swap", int(a_idx[i]), int(b)))
        # balance: a copy of the busiest device becomes a copy of another expert
        spare = self.T[self.row[a_idx]] > 1
        new_w = self.load / (self.T + 1)
        est2 = self.dl[top] - slot_w[a_idx][:, None] + new_w[None, :]
        est2 = np.where(spare[:, None] & (self.K[top][None, :] == 0), est2, np.inf)
        for f in np.argsort(est2, axis=None)[:k]:
            i, y = np.unravel_index(f, est2.shape)
            if np.isfinite(est2[i, y]):
                out.append(("copy", int(a_idx[i]), int(y)))
        if self.w > 0 and self.N > 1:
            # locality: a copy that is not its expert's last on its node goes to an expert absent
            # from that node (its tokens there stop crossing)
            x = self.row
            spare_slot = (self.KN[self.node, x] > 1) | (self.T[x] > 1)
            gain = self.load[None, :] * (self.KN[self.node][:, :] == 0) * self.frac[self.node][:, None]
            loss = (self.KN[self.node, x] == 1) * self.load[x] * self.frac[self.node]
            est3 = np.where(spare_slot[:, None] & (self.K[self.dev] == 0), loss[:, None] - gain, np.inf)
            for f in np.argsort(est3, axis=None)[:k]:
                a, y = np.unravel_index(f, est3.shape)
                if np.isfinite(est3[a, y]) and est3[a, y] < 0:
                    out.append(("copy", int(a), int(y)))
            if self.C is not None:
                # co-activation: move a single-node expert next to its partners
                part = self.C @ (self.KN > 0).T  # [E, N] partner mass per node
                single = np.nonzero(self.T == 1)[0]
                slot_of = np.zeros(len(self.load), dtype=int)
                slot_of[self.row] = np.arange(len(self.row))  # for single-copy experts: their slot
                if len(single):
                    pull = part[single] - part[single, self.node[slot_of[single]]][:, None]
                    for f in np.argsort(-pull, axis=None)[:k]:
                        i, n = np.unravel_index(f, pull.shape)
                        if pull[i, n] <= 0:
                            break
                        a = int(slot_of[single[i]])
                        cand = np.nonzero((self.node == n) & self._swaps(np.array([a]))[0])[0]
                        if len(cand):
                            b = int(cand[np.argmin(part[self.row[cand], n] - part[self.row[cand], self.node[a]])])
                            out.append(("swap", a, b))
        return out

    def run(self, max_moves: int = 400, k: int = 4) -> None:
        for _ in range(max_moves):
            best = None
            for kind, a, b in self._candidates(k):
                row = self.row.copy()
                if kind == "swap":
                    row[a], row[b] = row[b], row[a]
                else:
                    row[a] = b
                J = self.score(row)[0]
                if J < self.J - 1e-12 and (best is None or J < best[0]):
                    best = (J, row)
            if best is None:
                return
            self._set(best[1])


def plan_placement(load: list[list[float]], num_devices: int, devices_per_node: int, redundant_slots: int,
                   coact: list | None = None, *, node_of: list[int] | None = None,
                   locality_weight: float = DEFAULT_LOCALITY_WEIGHT) -> Placement:
    """Per layer: the placement minimising the weighted imbalance + cross-node objective (module doc)."""
    load = check_load(load)
    if not 0.0 <= float(locality_weight) <= 1.0:
        raise PlanError(f"locality_weight: must be in [0, 1], got {locality_weight}")
    if node_of is None:
        if devices_per_node < 1 or num_devices % devices_per_node:
            raise PlanError(f"devices_per_node: {devices_per_node} must divide num_devices={num_devices}")
        node_of = [d // devices_per_node for d in range(num_devices)]
    elif len(node_of) != num_devices:
        raise PlanError(f"node_of: lists {len(node_of)} devices, num_devices={num_devices}")
    E = len(load[0])
    if isinstance(redundant_slots, bool) or not isinstance(redundant_slots, int):
        raise PlanError(f"redundant_slots: must be an integer, got {redundant_slots!r}")
    spd = check_slots(E, E + redundant_slots, num_devices)
    if coact is not None and len(coact) != len(load):
        raise PlanError(f"coact: has {len(coact)} layers, load has {len(load)}")
    nodes = np.asarray(node_of)
    rows = []
    for i, lr in enumerate(load):
        lv = np.asarray(lr, dtype=float)
        c = check_coact(coact, i, E)
        # several starts: copies capped at one per device, one node's worth (which keeps a hot
        # expert's copies even across equal nodes) or half that (fewer, heavier copies leave room
        # to pack the rest); the local search ends in different optima
        dpn = int(np.bincount(nodes).max())
        caps = sorted({c for c in (num_devices, dpn, max(1, dpn // 2)) if c * E >= spd * num_devices}, reverse=True)
        best = None
        for cap in caps:
            s = _Search(_construct(lv, num_devices, nodes, spd, cap), lv, c, num_devices, nodes,
                        float(locality_weight))
            s.run()
            if best is None or s.J < best.J - 1e-12:
                best = s
        rows.append([int(e) for e in best.row])
    return Placement(rows, num_devices, list(node_of), ["planner"] * len(rows))


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
