"""The dispatch model placements are scored with: per-GPU load and cross-node traffic from one rule.

A placement is, per layer, a phy2log row of logical expert ids, one per physical slot, dealt to
`num_devices` equal groups in order (device d holds row[d*spd:(d+1)*spd]), the way
engine.model.layout.Layout deals slots to expert-parallel ranks.

Dispatch rule (locality first, the way node-aware all-to-all such as DeepEP is used): tokens
start evenly over the devices (attention data parallel). A token on device g that picked expert e
- stays on g when g holds a copy of e (split over g's copies);
- else goes to the copies of e on g's own node, split by copy count;
- else crosses the network, split over all copies of e.
Per-GPU load and cross-node copies both follow from this rule, so a placement cannot look
balanced under one model and local under another. An expert with a copy on every node never
crosses the network; replicas on one node only spread compute.

Co-activation (C[i, j] = tokens that picked both i and j) lowers cross-node copies: a token whose
remote experts sit on the same node crosses once and is forwarded over NVLink. The saving is
counted pairwise and scaled by 2/k (k = experts per token, from the data): exact for top-2 and a
lower bound on the saving beyond, so the model never claims fewer copies than one per remote node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Placement", "PlanError", "balance", "check_coact", "check_load", "check_slots", "cross_node_bytes",
           "cross_node_fraction", "layer_dispatch", "spread_loads", "worst_layer_balance"]


class PlanError(ValueError):
    """Input the planner refuses; the message names the field and the rule it breaks."""


@dataclass
class Placement:
    phy2log: list[list[int]]  # per layer, logical expert of each physical slot
    num_devices: int
    node_of: list[int]  # node index of each device
    source: list[str] = field(default_factory=list)  # per layer: who made the row ("planner", ...)

    @property
    def slots_per_device(self) -> int:
        return len(self.phy2log[0]) // self.num_devices if self.phy2log else 0

    def device_experts(self, layer: int, device: int) -> list[int]:
        s = self.slots_per_device
        return self.phy2log[layer][device * s:(device + 1) * s]


# ---------------------------------------------------------------------------------------------
# input rules

def check_load(load: object, name: str = "load") -> list[list[float]]:
    """Per-layer per-expert counts: a non-empty list of equal, non-empty rows of finite numbers >= 0."""
    if not isinstance(load, (list, tuple)) or not load:
        raise PlanError(f"{name}: must list at least one layer of per-expert counts")
    out: list[list[float]] = []
    for i, row in enumerate(load):
        if not isinstance(row, (list, tuple)) or not row:
            raise PlanError(f"{name}[{i}]: must list at least one expert's count")
        if len(row) != len(load[0]):
            raise PlanError(f"{name}[{i}]: has {len(row)} experts, {name}[0] has {len(load[0])}; "
                            "every layer must list the same experts")
        vals = []
        for j, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise PlanError(f"{name}[{i}][{j}]: must be a number, got {x!r}")
            if not math.isfinite(x):
                raise PlanError(f"{name}[{i}][{j}]: must be finite, got {x}")
            if x < 0:
                raise PlanError(f"{name}[{i}][{j}]: must be >= 0, got {x}")
            vals.append(float(x))
        out.append(vals)
    return out


def check_slots(num_experts: int, num_slots: int, num_devices: int, field_name: str = "redundant_slots") -> int:
    """Slots per device, or PlanError: every expert needs a slot, every device the same count,
    and no device can hold one expert twice."""
    if num_devices < 1:
        raise PlanError(f"num_devices: must be >= 1, got {num_devices}")
    if num_slots < num_experts:
        raise PlanError(f"{field_name}: {num_slots} slots for {num_experts} experts; "
                        "slots must be >= experts (every expert needs a slot)")
    if num_slots % num_devices:
        raise PlanError(f"{field_name}: {num_slots} slots do not split evenly over {num_devices} devices; "
                        "slots must be a multiple of the device count")
    spd = num_slots // num_devices
    if spd > num_experts:
        raise PlanError(f"{field_name}: {spd} slots per device but only {num_experts} experts; "
                        "a device would hold one expert twice")
    return spd


def check_coact(coact: list | None, layer: int, num_experts: int) -> np.ndarray | None:
    if coact is None or coact[layer] is None:
        return None
    c = np.asarray(coact[layer], dtype=float)
    if c.shape != (num_experts, num_experts):
        raise PlanError(f"coact[{layer}]: must be {num_experts} x {num_experts}, got {'x'.join(map(str, c.shape))}")
    if not np.isfinite(c).all() or (c < 0).any():
        raise PlanError(f"coact[{layer}]: counts must be finite and >= 0")
    return c


# ---------------------------------------------------------------------------------------------
# the model

def layer_dispatch(row: list[int] | np.ndarray, load: np.ndarray, num_devices: int, node_of: list[int] | np.ndarray,
                   coact: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """One layer under the dispatch rule: (per-device load, expected cross-node token copies)."""
    row = np.asarray(row)
    E, D = len(load), num_devices
    node = np.asarray(node_of)
    N = int(node.max()) + 1
    spd = len(row) // D
    dev = np.arange(len(row)) // spd
    K = np.bincount(dev * E + row, minlength=D * E).reshape(D, E).astype(float)  # copies per device
    onehot = np.zeros((N, D))
    onehot[node, np.arange(D)] = 1.0
    KN = onehot @ K  # copies per node
    T = K.sum(axis=0)
    dpn = onehot.sum(axis=1)
    has = K > 0
    lack_on_node = dpn[:, None] - onehot @ has  # devices of node n without a copy of e
    node_absent = KN == 0
    z = (dpn[:, None] * node_absent).sum(axis=0)  # devices whose node lacks e: their tokens cross
    share = load / D  # tokens of e starting on each device
    Tsafe = np.maximum(T, 1)
    per_dev = (has * 1.0
               + K * (lack_on_node / np.maximum(KN, 1))[node]
               + K * (z / Tsafe)[None, :])
    dl = (per_dev * share[None, :]).sum(axis=1)
    cross = float((share * z).sum())
    if coact is not None and N > 1 and cross > 0:
        total = float(load.sum())
        k = 1.0 + float(coact.sum()) / total if total > 0 else 2.0  # C's row sums are load * (k - 1)
        F = KN / Tsafe  # where a crossing token of e lands
        same = (F.T @ F) * coact  # P(two remote experts land on one node) x tokens with both
        np.fill_diagonal(same, 0.0)
        A = node_absent.astype(float)
        saved = 0.5 * float(np.einsum("n,ni,ij,nj->", dpn / D, A, same, A))
        cross -= saved * 2.0 / max(k, 2.0)
    return dl, max(cross, 0.0)


def _layers(placement: Placement, load: list[list[float]], coact: list | None):
    load = check_load(load)
    if len(load) != len(placement.phy2log):
        raise PlanError(f"load: has {len(load)} layers, the placement has {len(placement.phy2log)}")
    for i, (row, lr) in enumerate(zip(placement.phy2log, load, strict=True)):
        lv = np.asarray(lr, dtype=float)
        yield layer_dispatch(row, lv, placement.num_devices, placement.node_of,
                             check_coact(coact, i, len(lv))), lv


def _layer_balance(dl: np.ndarray) -> float:
    return float(dl.mean() / dl.max()) if dl.max() > 0 else 1.0


def spread_loads(row: list[int] | np.ndarray, load: np.ndarray, num_devices: int) -> np.ndarray:
    """Per-device load when every copy carries an equal share of its expert's tokens wherever
    they start (round-robin over copies, what EPLB assumes and engine/model/moe.py does today)."""
    row = np.asarray(row)
    reps = np.bincount(row, minlength=len(load))
    return (load[row] / reps[row]).reshape(num_devices, -1).sum(axis=1)


def _balances(placement: Placement, load: list[list[float]], dispatch: str) -> list[float]:
    if dispatch == "spread":
        load = check_load(load)
        return [_layer_balance(spread_loads(r, np.asarray(lr, dtype=float), placement.num_devices))
                for r, lr in zip(placement.phy2log, load, strict=True)]
    if dispatch != "local":
        raise ValueError(f"dispatch: 'local' or 'spread', got {dispatch!r}")
    return [_layer_balance(dl) for (dl, _), _ in _layers(placement, load, None)]


def balance(placement: Placement, load: list[list[float]], dispatch: str = "local") -> float:
    """Per layer mean/max device load, averaged over layers (1.0 = even). dispatch "local": the
    locality-first rule above; "spread": round-robin over all copies."""
    vals = _balances(placement, load, dispatch)
    return float(np.mean(vals)) if vals else 1.0


def worst_layer_balance(placement: Placement, load: list[list[float]], dispatch: str = "local") -> float:
    """The least balanced layer's mean/max device load: the layer every step waits for."""
    return min(_balances(placement, load, dispatch), default=1.0)


def cross_node_fraction(placement: Placement, load: list[list[float]], coact: list | None = None) -> float:
    """Cross-node token copies / all routed token copies, summed over layers."""
    cross = total = 0.0
    for (_, c), lv in _layers(placement, load, coact):
        cross += c
        total += float(lv.sum())
    return cross / total if total > 0 else 0.0


def cross_node_bytes(placement: Placement, load: list[list[float]], devices_per_node: int | None = None,
                     hidden_bytes: int = 1, coact: list | None = None) -> float:
    """Bytes the dispatch sends between nodes (one token copy = hidden_bytes), summed over layers.
    `devices_per_node` re-reads the placement on equal nodes of that size instead of its node_of."""
    if devices_per_node is not None:
        if devices_per_node < 1 or placement.num_devices % devices_per_node:
            raise PlanError(f"devices_per_node: {devices_per_node} must divide num_devices={placement.num_devices}")
        placement = Placement(placement.phy2log, placement.num_devices,
                              [d // devices_per_node for d in range(placement.num_devices)])
    return sum(c for (_, c), _ in _layers(placement, load, coact)) * hidden_bytes
