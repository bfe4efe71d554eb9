"""Layout: how a replica is split across its devices (docs/layouts.md).

attn_dp × attn_tp = world_size = moe_ep × moe_tp. `placement[layer]` lists, for each
physical expert slot, the logical expert it holds (EPLB's phy2log); slots are dealt to
expert-parallel ranks in order, len(placement[layer]) / moe_ep slots each.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from relayout.engine.model.config import ModelConfig


class LayoutError(ValueError):
    """An impossible layout; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"layout.{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Layout:
    attn_dp: int = 1
    attn_tp: int = 1
    moe_ep: int = 1
    moe_tp: int = 1
    placement: tuple[tuple[int, ...], ...] | None = None
    overlap: bool = False  # two-micro-batch overlap of the expert exchange

    @property
    def world_size(self) -> int:
        return self.attn_dp * self.attn_tp

    # ---- rank geometry -------------------------------------------------
    def dp_group_of(self, rank: int) -> int:
        return rank // self.attn_tp

    def attn_tp_rank(self, rank: int) -> int:
        return rank % self.attn_tp

    def ep_rank(self, rank: int) -> int:
        return rank // self.moe_tp

    def moe_tp_rank(self, rank: int) -> int:
        return rank % self.moe_tp

    def slots(self, layer: int, num_experts: int) -> tuple[int, ...]:
        if self.placement is None:
            return tuple(range(num_experts))
        return self.placement[layer]

    def kv_head_range(self, rank: int, num_kv_heads: int) -> tuple[int, int]:
        """KV heads held by `rank`; replicated when attn_tp exceeds their count."""
        tp = self.attn_tp_rank(rank)
        if self.attn_tp <= num_kv_heads:
            per = num_kv_heads // self.attn_tp
            return tp * per, (tp + 1) * per
        rep = self.attn_tp // num_kv_heads
        h = tp // rep
        return h, h + 1

    # ---- parsing / printing ------------------------------------------
    @classmethod
    def parse(cls, text: str | dict | None) -> Layout:
        if text is None or text == "":
            return cls()
        if isinstance(text, dict):
            return cls.from_dict(text)
        text = text.strip()
        if text.startswith("{"):
            try:
                return cls.from_dict(json.loads(text))
            except json.JSONDecodeError as e:
                raise LayoutError("json", f"not valid JSON: {e}") from None
        d: dict = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise LayoutError(part, "expected key=value (e.g. attn_dp=2,attn_tp=1,moe_ep=2,moe_tp=1)")
            k, v = (s.strip() for s in part.split("=", 1))
            d[k] = v
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        known = {"attn_dp", "attn_tp", "moe_ep", "moe_tp", "placement", "overlap", "world_size"}
        for k in d:
            if k not in known:
                raise LayoutError(str(k), f"unknown field (known: {', '.join(sorted(known))})")
        kw: dict = {}
        for k in ("attn_dp", "attn_tp", "moe_ep", "moe_tp"):
            if k in d:
                try:
                    v = int(d[k])
                except (TypeError, ValueError):
                    raise LayoutError(k, f"must be a positive integer, got {d[k]!r}") from None
                if isinstance(d[k], bool) or v < 1:
                    raise LayoutError(k, f"must be a positive integer, got {d[k]!r}")
                kw[k] = v
        if "overlap" in d:
            ov = d["overlap"]
            kw["overlap"] = ov if isinstance(ov, bool) else str(ov).lower() in ("1", "true", "yes", "on")
        if d.get("placement") is not None:
            p = d["placement"]
            if isinstance(p, str):
                try:
                    p = json.loads(p)
                except json.JSONDecodeError:
                    raise LayoutError("placement", "must be a JSON list of per-layer slot lists") from None
            if not isinstance(p, list) or not all(isinstance(row, list) for row in p):
                raise LayoutError("placement", "must be a list (per layer) of lists of expert ids")
            try:
                kw["placement"] = tuple(tuple(int(x) for x in row) for row in p)
            except (TypeError, ValueError):
                raise LayoutError("placement", "expert ids must be integers") from None
        if "moe_ep" not in kw:
            # experts default to expert parallelism over every rank the attention split uses
            world = kw.get("attn_dp", 1) * kw.get("attn_tp", 1)
            kw["moe_ep"] = max(1, world // kw.get("moe_tp", 1))
        lay = cls(**kw)
        if "world_size" in d and int(d["world_size"]) != lay.world_size:
            raise LayoutError("world_size", f"{d['world_size']} != attn_dp*attn_tp = {lay.world_size}")
        return lay

    def to_dict(self) -> dict:
        d = asdict(self)
        d["placement"] = [list(r) for r in self.placement] if self.placement is not None else None
        return d

    def __str__(self) -> str:
        s = f"attn_dp={self.attn_dp},attn_tp={self.attn_tp},moe_ep={self.moe_ep},moe_tp={self.moe_tp}"
        if self.overlap:
            s += ",overlap=true"
        if self.placement is not None:
            s += ",placement=custom"
        return s

    # ---- validation ----------------------------------------------------
    def validate(self, cfg: ModelConfig) -> Layout:
        """Refuse an impossible layout before any process starts."""
        if self.attn_dp * self.attn_tp != self.moe_ep * self.moe_tp:
            raise LayoutError(
                "moe_ep",
                f"attn_dp*attn_tp = {self.attn_dp * self.attn_tp} but moe_ep*moe_tp = {self.moe_ep * self.moe_tp}; "
                "both must equal world_size",
            )
        if cfg.num_heads % self.attn_tp != 0:
            raise LayoutError("attn_tp", f"{self.attn_tp} does not divide num_attention_heads={cfg.num_heads}")
        if self.attn_tp > cfg.num_kv_heads:
            if self.attn_tp % cfg.num_kv_heads != 0:
                raise LayoutError(
                    "attn_tp", f"{self.attn_tp} is neither a divisor nor a multiple of num_kv_heads={cfg.num_kv_heads}"
                )
        elif cfg.num_kv_heads % self.attn_tp != 0:
            raise LayoutError("attn_tp", f"{self.attn_tp} does not divide num_key_value_heads={cfg.num_kv_heads}")
        if cfg.moe_intermediate_size % self.moe_tp != 0:
            raise LayoutError(
                "moe_tp", f"{self.moe_tp} does not divide moe_intermediate_size={cfg.moe_intermediate_size}"
            )
        if cfg.dense_layers and cfg.dense_intermediate_size % self.world_size != 0:
            raise LayoutError(
                "moe_tp", f"world_size {self.world_size} does not divide dense intermediate_size"
            )
        if self.placement is None:
            if cfg.num_experts % self.moe_ep != 0:
                raise LayoutError(
                    "moe_ep",
                    f"{self.moe_ep} does not divide num_experts={cfg.num_experts}; give a placement with "
                    "redundant slots to use this expert parallelism",
                )
        else:
            if len(self.placement) != cfg.num_layers:
                raise LayoutError(
                    "placement", f"has {len(self.placement)} layers, the model has {cfg.num_layers}"
                )
            for layer, row in enumerate(self.placement):
                if not cfg.is_moe_layer(layer):
                    continue
                if len(row) == 0 or len(row) % self.moe_ep != 0:
                    raise LayoutError(
                        "placement",
                        f"layer {layer} has {len(row)} slots; the slot count must be a positive multiple of moe_ep={self.moe_ep}",
                    )
                bad = [e for e in row if not 0 <= e < cfg.num_experts]
                if bad:
                    raise LayoutError("placement", f"layer {layer} names experts {bad} outside 0..{cfg.num_experts - 1}")
                missing = sorted(set(range(cfg.num_experts)) - set(row))
                if missing:
                    raise LayoutError("placement", f"layer {layer} is missing experts {missing}")
                per = len(row) // self.moe_ep
                for r in range(self.moe_ep):
                    mine = row[r * per : (r + 1) * per]
                    if len(set(mine)) != len(mine):
                        raise LayoutError("placement", f"layer {layer} puts one expert twice on ep rank {r}")
        return self
