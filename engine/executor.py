"""Executors run a step on a replica's ranks. World size 1 runs in-process; larger
layouts run one process per rank (engine/workers.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from relayout.engine.config import ModelConfig
from relayout.engine.layout import Layout
from relayout.engine.parallel import ParallelState
from relayout.engine.runner import ModelRunner, StepBatch


class Executor(Protocol):
    def execute(self, batches: list[StepBatch]) -> list[torch.Tensor]: ...

    def export_kv(self, group: int, blocks: list[int], tok_lo: int, tok_hi: int) -> list[tuple[int, int, torch.Tensor]]: ...

    def import_kv(self, group: int, blocks: list[int], tok_lo: int, kv: torch.Tensor) -> None: ...

    def reserve_kv_scratch(self, group: int, n_blocks: int) -> None: ...

    def moe_stats(self) -> list[dict]: ...

    def shutdown(self) -> None: ...


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

    def moe_stats(self) -> list[dict]:
        return [self.runner.moe_stats()]

    def shutdown(self) -> None:
        pass
