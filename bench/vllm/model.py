"""A Qwen3-MoE small enough for vLLM's CPU build on 2 cores and large enough for its CPU attention
(head_dim 64, which vLLM's CPU attention needs; builtin:tiny's 16 it refuses): random weights written
by transformers' save_pretrained and a byte-level BPE tokenizer trained with `tokenizers` on generated
text (nothing downloaded). The vLLM bench's default model and the vLLM tests' model."""

from __future__ import annotations

import random
from pathlib import Path

VOCAB = 512
EOS = "<|endoftext|>"
# ChatML, as Qwen's models use it (its markers are plain text to this tokenizer)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _corpus():
    rnd = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while kv cache blocks move between replicas".split()
    for _ in range(3000):
        yield " ".join(rnd.choice(words) for _ in range(rnd.randint(3, 12))) + "."


def make_tiny_qwen3_moe(out: Path, max_positions: int = 2048) -> Path:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_corpus(), vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, pad_token=EOS)
    tok.chat_template = CHAT_TEMPLATE
    eos = tok.convert_tokens_to_ids(EOS)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                         max_position_embeddings=max_positions, eos_token_id=eos, bos_token_id=eos,
                         pad_token_id=eos, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF's init (std 0.02) gives near-uniform logits: larger weights, decisive tokens
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
