"""Who this rank is within a replica's layout, and the collectives it uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from relayout.engine.model.layout import Layout


@dataclass
class CommStats:
    """All-to-all bytes per destination rank, and per-layer exposed/total exchange time."""

    bytes_to: list[int] = field(default_factory=list)
    exposed_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)


@dataclass
class ParallelState:
    layout: Layout
    rank: int = 0
    tp_group: Any = None  # attention tensor-parallel group (None when attn_tp == 1)
    tp_ranks: list[int] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    @property
    def attn_tp(self) -> int:
        return self.layout.attn_tp

    @property
    def tp_rank(self) -> int:
        return self.layout.attn_tp_rank(self.rank)

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.attn_tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x


def init_groups(layout: Layout, rank: int) -> ParallelState:
    """Create the attention-TP groups (every rank must create every group, in order)."""
    ps = ParallelState(layout=layout, rank=rank)
    if layout.attn_tp > 1:
        for g in range(layout.attn_dp):
            ranks = list(range(g * layout.attn_tp, (g + 1) * layout.attn_tp))
            grp = dist.new_group(ranks)
            if rank in ranks:
                ps.tp_group, ps.tp_ranks = grp, ranks
    return ps
