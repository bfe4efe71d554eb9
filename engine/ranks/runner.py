"""One rank's model and KV tensors; turns a scheduled step into logits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from relayout.engine.kv_cache import BLOCK_SIZE, KVCache
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.model import AttnMeta, MoEModel, decode_mask
from relayout.engine.model.moe import SparseMoE
from relayout.engine.model.parallel import ParallelState
from relayout.engine.ranks.shared_kv import SharedPool, create_pool
from relayout.engine.ranks.staging import KVStager
from relayout.storage.settings import settings


@dataclass
class StepBatch:
    """One attention data-parallel group's share of a step, in plain lists (cheap to send to ranks)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    logits_at: list[int] = field(default_factory=list)  # flat token index whose logits are wanted

    @property
    def empty(self) -> bool:
        return not self.input_ids




class ModelRunner:
    def __init__(self, cfg: ModelConfig, ps: ParallelState, model_dir: Path, num_blocks: int,
                 device: torch.device, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None,
                 shared_kv: bool = False):
        self.cfg, self.ps, self.device = cfg, ps, device
        self.model = MoEModel(cfg, ps, dtype).to(device)
        self.model.load(model_dir)
        self.model.eval()
        lo, hi = ps.layout.kv_head_range(ps.rank, cfg.num_kv_heads)
        self.kv_range = (lo, hi)
        # kv_dtype: the pool's element type (None: the model dtype; float8 keeps scales beside it)
        # shared_kv (a local CPU rank): the pool in shared memory, so the driver copies KV in and out
        # of it directly (engine.ranks.shared_kv); None where it cannot be
        shared = (create_pool(cfg.num_layers, (num_blocks, BLOCK_SIZE, hi - lo, cfg.head_dim), kv_dtype or dtype, (lo, hi))
                  if shared_kv and device.type == "cpu" else None)
        self.shared_pool: SharedPool | None = shared[0] if shared else None
        self.kv = KVCache(cfg.num_layers, num_blocks, hi - lo, cfg.head_dim, kv_dtype or dtype, device,
                          compute_dtype=dtype, tensors=shared[1:] if shared else None)
        # on CUDA, KV leaves and enters through pinned staging buffers on side streams
        # (engine/ranks/staging.py); on the CPU the plain host copies below are already the fastest path
        self.stager: KVStager | None = (KVStager(device, max_bytes=settings().staging_bytes) if device.type == "cuda"
                                        else None)

    def execute(self, b: StepBatch) -> torch.Tensor:
        dev = self.device
        if b.empty:
            # still take part in the experts' all-to-all
            meta = AttnMeta(torch.empty(0, dtype=torch.long, device=dev), False,
                            torch.empty(0, 1, dtype=torch.long, device=dev), torch.empty(0, dtype=torch.long), [])
            return self.model(torch.empty(0, dtype=torch.long, device=dev), torch.empty(0, dtype=torch.long, device=dev),
                              meta, self.kv, torch.empty(0, dtype=torch.long, device=dev)).cpu()
        decode = all(q == 1 for q in b.query_lens)
        maxb = max(len(t) for t in b.block_tables)
        bt = torch.tensor([t + [0] * (maxb - len(t)) for t in b.block_tables], dtype=torch.long, device=dev)
        meta = AttnMeta(
            slots=torch.tensor(b.slot_mapping, dtype=torch.long, device=dev),
            decode=decode,
            block_tables=bt,
            context_lens=torch.tensor(b.context_lens, dtype=torch.long, device=dev),
            query_lens=b.query_lens,
        )
        if decode:
            meta.decode_mask = decode_mask(meta.context_lens, maxb * BLOCK_SIZE)
        ids = torch.tensor(b.input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(b.positions, dtype=torch.long, device=dev)
        at = torch.tensor(b.logits_at, dtype=torch.long, device=dev)
        return self.model(ids, pos, meta, self.kv, at).cpu()

    # ---- session KV in and out ----------------------------------------
    def export_kv(self, blocks: list[int], tok_lo: int, tok_hi: int) -> torch.Tensor:
        self.kv.refuse_quantised()  # before the staging path, which knows no scales
        if self.stager is not None and tok_hi > tok_lo:
            # a view of a pinned pool buffer: it goes back to the pool once the caller drops it
            return self.stager.export(self.kv, blocks, tok_lo, tok_hi).wait()
        return self.kv.export_tokens(blocks, tok_lo, tok_hi).cpu()

    def import_kv(self, blocks: list[int], tok_lo: int, kv: torch.Tensor, heads: list[int] | None = None) -> None:
        """`kv` holds KV heads `heads` [lo, hi) (default: all heads); this rank keeps its own range."""
        self.kv.refuse_quantised()
        lo, hi = self.kv_range
        base = heads[0] if heads is not None else 0
        if heads is not None and not (heads[0] <= lo and hi <= heads[1]):
            raise ValueError(f"import of KV heads {heads} does not cover this rank's heads [{lo}, {hi})")
        mine = kv[:, :, lo - base:hi - base]
        if self.stager is not None:
            # returns at once: the compute stream waits for the copy before the next step
            self.stager.import_(self.kv, blocks, tok_lo, mine)
            return
        for layer in range(mine.shape[0]):  # run by run of consecutive blocks, as the host restore does
            self.kv.import_from(blocks, layer, tok_lo, mine[layer])

    # ---- measurements --------------------------------------------------
    def moe_stats(self) -> dict:
        counts, bytes_to, exposed, total = [], [], [], []
        for layer in self.model.layers:
            m = layer.mlp
            if isinstance(m, SparseMoE):
                counts.append(m.expert_counts.tolist())
                bytes_to.append(list(m.bytes_to))
                exposed.append(m.exposed_s)
                total.append(m.total_s)
            else:
                counts.append([])
                bytes_to.append([0] * self.ps.world_size)
                exposed.append(0.0)
                total.append(0.0)
        return {"expert_counts": counts, "bytes_to": bytes_to, "exposed_s": exposed, "total_s": total}


def kv_block_bytes(cfg: ModelConfig, kv_heads: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one KV block takes across every layer (float8: with its float32 scale per token and head)."""
    per_head = BLOCK_SIZE * (cfg.head_dim * dtype.itemsize + (4 if dtype.itemsize == 1 else 0))
    return 2 * cfg.num_layers * kv_heads * per_head
