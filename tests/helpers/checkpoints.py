"""Small checkpoints for the format tests: random KV of a 2-layer, 4-KV-head model, written the way
an attn_tp=2 source writes it."""

from __future__ import annotations

import torch
from relayout.storage.checkpoint import CheckpointWriter
from relayout.storage.format.manifest import KVGeometry, Manifest, ModelRef
from relayout.storage.stores import Store

L, H, D = 2, 4, 8
MODEL = ModelRef(name="builtin:tiny", fingerprint="fp-1", config={"layers": L})
LAYOUT = {"attn_dp": 1, "attn_tp": 2, "moe_ep": 2, "moe_tp": 1}


def kv_tensor(seed: int, tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, H, tokens, D, generator=g).to(dtype)


def write_checkpoint(
    store: Store,
    cid: str,
    sessions: dict[str, torch.Tensor],
    codec: str = "none",
    head_splits: tuple[tuple[int, int], ...] = ((0, 2), (2, 4)),
    tok_splits: int = 3,
) -> Manifest:
    """Write like an attn_tp=2 source: 2 head ranges × ``tok_splits`` token ranges per layer."""
    w = CheckpointWriter(store, cid, codec=codec)
    dtype = next(iter(sessions.values())).dtype
    for sid, kv in sessions.items():
        t = kv.shape[3]
        bounds = sorted({0, t, *(t * i // tok_splits for i in range(1, tok_splits))})
        for layer in range(L):
            for hl, hh in head_splits:
                for tl, th in zip(bounds[:-1], bounds[1:], strict=True):
                    w.put_kv(sid, layer, hl, hh, tl, th, kv[layer, :, hl:hh, tl:th])
        w.add_session(sid, {"prompt": [1, 2, 3], "generated": [4]}, t)
    return w.commit(MODEL, LAYOUT, KVGeometry(num_layers=L, num_kv_heads=H, head_dim=D, dtype=str(dtype)[6:]))
