"""Re-layout policy (docs/layouts.md): watch a replica's traffic; relayout when it pays for the move.

Input: successive observations of one replica (`GET /v1/replica`): cumulative per-layer
per-expert routed-token counts (folded into an EMA of per-interval deltas by
planner.ExpertLoad), the live sessions (concurrency, and their KV bytes = tokens × KV
bytes per token) and the current layout.

Gain model. A decode step is `moe_fraction` MoE and the MoE part waits for the busiest
expert-parallel rank, so its time is ∝ max device load = mean / balance. Moving from
balance b_old (the current layout's placement, or the identity one) to b_new (the
planner's placement for the EMA load) saves the fraction

    improvement = 1 - b_old / b_new     (= b_old · (1/b_old - 1/b_new))

of the MoE time. Over a horizon the replica is expected to produce `tokens/s × horizon`
tokens at `token_time_s` each (default: the observed interval / tokens, i.e. it is busy),
so

    expected_gain_s = tokens/s × horizon_s × token_time_s × moe_fraction × improvement.

Cost model: the sessions' KV bytes over the link, plus a stall per session (configured,
then the measured stall of the last migration), plus the new replica's launch time
(configured, then measured):

    move_cost_s = kv_bytes / link_bytes_per_s + sessions × stall_s + launch_s.

Hysteresis: relayout only when expected_gain > move_cost × margin (and the improvement is
at least `min_improvement`) for `consecutive` observations in a row, and not within
`cooldown_s` of the last relayout. A shift too small to pay for the move never triggers one.
The attention split and world size are kept; only the expert placement changes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from relayout.engine.model.layout import Layout
from relayout.migrate.placement.planner import ExpertLoad, Placement, balance, plan_placement, redundant_for

__all__ = ["Decision", "Observation", "PolicyConfig", "RelayoutPolicy", "current_placement", "plan_for"]


@dataclass
class PolicyConfig:
    margin: float = 1.5  # gain must beat cost × margin
    consecutive: int = 3  # ... for this many observations in a row (K)
    cooldown_s: float = 600.0  # no relayout within this long of the last one
    horizon_s: float = 600.0  # how far ahead the gain is counted
    moe_fraction: float = 0.5  # share of a decode step spent in the MoE layers
    token_time_s: float | None = None  # seconds of replica time per token; None: interval / tokens
    min_improvement: float = 0.02  # below this fraction of MoE time saved, never move
    link_gbps: float = 10.0  # GB/s between the replicas (KV transfer)
    stall_s: float = 0.05  # pause per session at stop-and-copy (replaced by the measured one)
    launch_s: float = 30.0  # time to launch the new replica (replaced by the measured one)
    alpha: float = 0.3  # EMA weight of the newest window
    redundant_slots: int | None = None  # None: planner.redundant_for(E, moe_ep)
    top_k: int = 2  # experts per token (tokens = routed pairs / top_k / MoE layers)
    kv_bytes_per_token: int = 0  # 0: unknown (the controller fills it from the model)


@dataclass
class Observation:
    expert_counts: list[list[float]]  # cumulative, per layer (empty rows for dense layers)
    layout: Layout
    sessions: int = 0
    kv_tokens: int = 0
    t: float = field(default_factory=time.monotonic)

    @classmethod
    def from_replica(cls, rep: dict, t: float | None = None) -> Observation:
        live = [s for s in rep.get("sessions", []) if s.get("state") not in ("finished", "migrated")]
        return cls(expert_counts=[[float(c) for c in row] for row in rep["expert_counts"]],
                   layout=Layout.parse(rep.get("layout")), sessions=len(live),
                   kv_tokens=int(sum(int(s.get("num_tokens", 0)) for s in live)),
                   t=time.monotonic() if t is None else t)


@dataclass
class Decision:
    action: str  # "stay" | "relayout"
    new_layout: Layout | None
    expected_gain: float  # seconds saved over the horizon
    move_cost: float  # seconds the move costs
    reason: str
    balance_old: float | None = None
    balance_new: float | None = None
    streak: int = 0
    sessions: int = 0
    kv_bytes: int = 0
    tokens_per_s: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["new_layout"] = self.new_layout.to_dict() if self.new_layout is not None else None
        for k in ("expected_gain", "move_cost", "balance_old", "balance_new", "tokens_per_s"):
            if d[k] is not None:
                d[k] = round(d[k], 4)
        return d


def _moe_rows(counts: list[list[float]]) -> list[int]:
    return [i for i, row in enumerate(counts) if len(row) > 0]


def current_placement(layout: Layout, num_experts: int, moe_layers: list[int]) -> Placement:
    """The layout's placement on its MoE layers (identity when it names none)."""
    rows = [list(layout.slots(i, num_experts)) for i in moe_layers]
    return Placement(rows, layout.moe_ep, [0] * layout.moe_ep)


def plan_for(layout: Layout, load: list[list[float]], moe_layers: list[int], num_layers: int,
             redundant_slots: int | None = None) -> tuple[Placement, Layout]:
    """The planner's placement for `load` (MoE layers only) on the layout's expert-parallel ranks,
    and the layout carrying it (same attention split; dense layers keep identity rows)."""
    E = len(load[0])
    ep = layout.moe_ep
    red = redundant_for(E, ep) if redundant_slots is None else redundant_slots
    p = plan_placement(load, ep, ep, red)  # one replica's ranks share a node
    rows: list[tuple[int, ...]] = []
    it = iter(p.phy2log)
    for i in range(num_layers):
        rows.append(tuple(next(it)) if i in moe_layers else tuple(range(E)))
    return p, Layout(attn_dp=layout.attn_dp, attn_tp=layout.attn_tp, moe_ep=ep, moe_tp=layout.moe_tp,
                     placement=tuple(rows), overlap=layout.overlap)


class RelayoutPolicy:
    def __init__(self, config: PolicyConfig | None = None, **overrides):
        self.cfg = config or PolicyConfig()
        for k, v in overrides.items():
            if not hasattr(self.cfg, k):
                raise TypeError(f"unknown policy setting {k!r}")
            setattr(self.cfg, k, v)
        if self.cfg.consecutive < 1 or self.cfg.margin <= 0:
            raise ValueError("consecutive must be >= 1 and margin > 0")
        self.load = ExpertLoad()
        self.tokens_per_s: float | None = None
        self.streak = 0
        self.last_relayout: float | None = None
        self._prev: Observation | None = None
        self.decisions: list[Decision] = []

    # ---- feedback from the controller -------------------------------------------------------
    def committed(self, layout: Layout, now: float | None = None, *, launch_s: float | None = None,
                  stall_ms: float | None = None, sessions: int = 0) -> None:
        """A relayout to `layout` happened: a new replica (fresh counters), cooldown from now,
        and the measured launch time / stall replace the configured ones."""
        self.last_relayout = time.monotonic() if now is None else now
        self._prev = None  # the new replica's counters start from zero: re-prime
        self.streak = 0
        if launch_s is not None:
            self.cfg.launch_s = float(launch_s)
        if stall_ms is not None and sessions > 0:
            # live migration pauses every session for the same stop-and-copy
            self.cfg.stall_s = float(stall_ms) / 1000.0

    def aborted(self, now: float | None = None) -> None:
        """The relayout failed; the cooldown still applies so a broken target is not retried at once."""
        self.last_relayout = time.monotonic() if now is None else now
        self.streak = 0

    # ---- the decision --------------------------------------------------------------------------
    def observe(self, obs: Observation | dict, now: float | None = None) -> Decision:
        if isinstance(obs, dict):
            obs = Observation.from_replica(obs, now)
        d = self._decide(obs)
        self.decisions.append(d)
        return d

    def _stay(self, reason: str, **kw) -> Decision:
        self.streak = 0
        return Decision("stay", None, kw.pop("gain", 0.0), kw.pop("cost", 0.0), reason, streak=0, **kw)

    def _decide(self, obs: Observation) -> Decision:
        c = self.cfg
        prev, self._prev = self._prev, obs
        moe = _moe_rows(obs.expert_counts)
        kv_bytes = obs.kv_tokens * c.kv_bytes_per_token
        info = {"sessions": obs.sessions, "kv_bytes": kv_bytes}
        if not moe:
            return self._stay("no MoE layers reported", **info)
        if prev is None or len(prev.expert_counts) != len(obs.expert_counts):
            return self._stay("first observation of this replica: counters primed", **info)
        delta = [[a - b for a, b in zip(obs.expert_counts[i], prev.expert_counts[i], strict=True)] for i in moe]
        if any(x < 0 for row in delta for x in row):
            return self._stay("expert counters went backwards (replica restarted): re-primed", **info)
        dt = max(obs.t - prev.t, 1e-9)
        pairs = sum(sum(row) for row in delta)
        tokens = pairs / max(1, c.top_k) / len(moe)
        rate = tokens / dt
        self.tokens_per_s = rate if self.tokens_per_s is None else (1 - c.alpha) * self.tokens_per_s + c.alpha * rate
        if tokens > 0:
            self.load.update(delta, c.alpha)
        info["tokens_per_s"] = self.tokens_per_s
        if self.load.load is None:
            return self._stay("no routed tokens observed yet", **info)
        load = self.load.load
        E = len(load[0])
        cur = obs.layout
        if E % cur.moe_ep and cur.placement is None:
            return self._stay(f"moe_ep={cur.moe_ep} does not divide {E} experts and no placement given", **info)
        b_old = balance(current_placement(cur, E, moe), load)
        try:
            newp, new_layout = plan_for(cur, load, moe, len(obs.expert_counts), c.redundant_slots)
        except ValueError as e:  # PlanError: no placement for this shape
            return self._stay(f"planner: {e}", balance_old=b_old, **info)
        b_new = balance(newp, load)
        info.update(balance_old=b_old, balance_new=b_new)
        improvement = 1.0 - b_old / b_new if b_new > 0 else 0.0
        token_time = c.token_time_s if c.token_time_s is not None else (dt / tokens if tokens > 0 else 0.0)
        gain = self.tokens_per_s * c.horizon_s * token_time * c.moe_fraction * max(0.0, improvement)
        link = c.link_gbps * 1e9
        transfer_s = kv_bytes / link if link > 0 else 0.0
        cost = transfer_s + obs.sessions * c.stall_s + c.launch_s
        numbers = (f"balance {b_old:.3f} -> {b_new:.3f} ({improvement * 100:.1f}% of MoE time); "
                   f"gain {gain:.1f}s over {c.horizon_s:g}s vs cost {cost:.1f}s (transfer {transfer_s:.2f}s, "
                   f"stall {obs.sessions}x{c.stall_s * 1000:.0f}ms, launch {c.launch_s:.1f}s) x margin {c.margin:g}")
        if self.last_relayout is not None and obs.t - self.last_relayout < c.cooldown_s:
            left = c.cooldown_s - (obs.t - self.last_relayout)
            return self._stay(f"cooldown: {left:.0f}s left since the last relayout; {numbers}", gain=gain, cost=cost,
                              **info)
        if improvement < c.min_improvement:
            return self._stay(f"shift too small: {numbers}", gain=gain, cost=cost, **info)
        if gain <= cost * c.margin:
            return self._stay(f"gain does not pay for the move: {numbers}", gain=gain, cost=cost, **info)
        self.streak += 1
        if self.streak < c.consecutive:
            return Decision("stay", None, gain, cost, f"favourable {self.streak}/{c.consecutive} in a row: {numbers}",
                            streak=self.streak, **info)
        streak, self.streak = self.streak, 0
        # the cooldown starts at the decision, so a failing move is not retried every interval
        self.last_relayout = obs.t
        return Decision("relayout", new_layout, gain, cost,
                        f"favourable {streak}/{c.consecutive} in a row: {numbers}", streak=streak, **info)
