"""The vLLM tests' model (relayout.bench.vllm.model: a tiny Qwen3-MoE vLLM's CPU build runs) and its
yardstick: transformers' greedy tokens on the same weights."""

from __future__ import annotations

from pathlib import Path

import torch
from relayout.bench.vllm.model import make_tiny_qwen3_moe  # noqa: F401 - re-exported to the tests


def reference_tokens(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of transformers' generate on the same weights (fp32), the yardstick."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,  # EOS ignored, as the tests ask (ignore_eos),
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()
