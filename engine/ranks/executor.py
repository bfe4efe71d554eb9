"""Executors run a step on a replica's ranks. World size 1 runs in-process; larger
layouts run one process per rank (engine/ranks/workers.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from relayout.engine.kv_cache import KVCache
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.layout import Layout
from relayout.engine.model.parallel import ParallelState
from relayout.engine.ranks.runner import ModelRunner, StepBatch


class Executor(Protocol):
    def execute(self, batches: list[StepBatch]) -> list[torch.Tensor]: ...

    def export_kv(self, group: int, blocks: list[int], tok_lo: int, tok_hi: int) -> list[tuple[int, int, torch.Tensor]]: ...

    def import_kv(self, group: int, blocks: list[int], tok_lo: int, kv: torch.Tensor) -> None: ...

    def reserve_kv_scratch(self, group: int, n_blocks: int) -> None: ...

    def own_pool(self) -> HostPool | None:
        """This process's KV pool when it holds all of it in host memory (one local rank, no
        staging): snapshots copy straight between its blocks and chunk buffers."""
        ...

    def host_pools(self, group: int, every_copy: bool = False) -> list[HostPool] | None:
        """The host pools this process can copy attention-DP group `group`'s KV out of (and into)
        itself, with the KV heads each holds: its own pool, or its local ranks' pools in shared
        memory (engine.ranks.shared_kv). Heads replicated on several ranks come once, or, with
        `every_copy` (an import: every copy must get them), once per rank. None: through
        export_kv/import_kv."""
        ...

    def moe_stats(self) -> list[dict]: ...

    def shutdown(self) -> None: ...


HostPool = tuple[KVCache, tuple[int, int]]  # a KV pool in this process's memory, with the KV heads it holds


class LocalExecutor:
    def __init__(self, cfg: ModelConfig, layout: Layout, model_dir: Path, num_blocks: int, device: torch.device,
                 dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
        self.runner = ModelRunner(cfg, ParallelState(layout), model_dir, num_blocks, device, dtype, kv_dtype)

    def execute(self, batches: list[StepBatch]) -> list[torch.Tensor]:
        return [self.runner.execute(batches[0])]

    def export_kv(self, group: int, blocks: list[int], tok_lo: int, tok_hi: int) -> list[tuple[int, int, torch.Tensor]]:
        lo, hi = self.runner.kv_range
        return [(lo, hi, self.runner.export_kv(blocks, tok_lo, tok_hi))]

    def import_kv(self, group: int, blocks: list[int], tok_lo: int, kv: torch.Tensor) -> None:
        self.runner.import_kv(blocks, tok_lo, kv)

    def reserve_kv_scratch(self, group: int, n_blocks: int) -> None:
        self.runner.kv.reserve_scratch(n_blocks)

    def own_pool(self) -> HostPool | None:
        r = self.runner
        if r.stager is not None or r.kv.k[0].device.type != "cpu":
            return None
        return r.kv, r.kv_range

    def host_pools(self, group: int, every_copy: bool = False) -> list[HostPool] | None:
        one = self.own_pool()
        return None if one is None else [one]

    def moe_stats(self) -> list[dict]:
        return [self.runner.moe_stats()]

    def shutdown(self) -> None:
        pass
