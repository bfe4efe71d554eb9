"""The MoE transformer (Qwen3-MoE and Mixtral) for one rank of one layout, over a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from relayout.engine.kv_cache import KVCache
from relayout.engine.model.batch_invariant import batch_invariant, linear, pack_cpu_weight
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.moe import SparseMoE
from relayout.engine.model.parallel import ParallelState


@dataclass
class AttnMeta:
    """Where this step's tokens sit in the paged cache.

    Decode steps (one new token per session) run batched over padded block tables;
    prefill chunks run per session with a causal mask offset by what is already cached.
    """

    slots: torch.Tensor  # [T] cache slot of each new token
    decode: bool
    block_tables: torch.Tensor  # [B, max_blocks] (padded with 0)
    context_lens: torch.Tensor  # [B] tokens in cache after this step
    query_lens: list[int]
    # decode: [B, 1, 1, max_ctx] True where a cached position is attended (built once per step, not per layer)
    decode_mask: torch.Tensor | None = None


def decode_mask(context_lens: torch.Tensor, max_ctx: int) -> torch.Tensor:
    """[B, 1, 1, max_ctx]: True for the cached positions each decoding session attends to."""
    B = context_lens.shape[0]
    return (torch.arange(max_ctx, device=context_lens.device)[None, :] < context_lens[:, None]).view(B, 1, 1, max_ctx)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x normalised over its last dim), as transformers computes it: in float32, rounded to
    x's dtype before the weight multiply (F.rms_norm without a weight gives its steps bit for bit, in
    one op where they took six)."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


class Rotary:
    """cos and a signed sin per position: x * cos + roll(x, d/2) * sin is transformers'
    x * cos + rotate_half(x) * sin bit for bit (cat(-x2, x1) * sin = cat(x2, x1) * cat(-sin1, sin2)),
    in three ops instead of six."""

    def __init__(self, head_dim: int, theta: float):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.cos = self.sin = torch.empty(0)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max().item()) + 1 if positions.numel() else 1
        if self.cos.shape[0] < need or self.cos.device != positions.device:
            n = max(need, 2 * self.cos.shape[0], 256)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1).to(positions.device)
            self.cos, self.sin = emb.cos(), emb.sin()
            self.sin[:, : freqs.shape[1]].neg_()
        return self.cos[positions], self.sin[positions]


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, layer: int, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.ps, self.layer = cfg, ps, layer
        tp = ps.layout.attn_tp
        self.n_heads = cfg.num_heads // tp
        lo, hi = ps.layout.kv_head_range(ps.rank, cfg.num_kv_heads)
        self.kv_range = (lo, hi)
        self.n_kv = hi - lo
        self.q_range = (ps.tp_rank * self.n_heads, (ps.tp_rank + 1) * self.n_heads)
        d, h = cfg.head_dim, cfg.hidden_size
        p = lambda *s: torch.nn.Parameter(torch.empty(*s, dtype=dtype), requires_grad=False)  # noqa: E731
        # q, k and v in one weight: one matmul per layer instead of three
        self.qkv_proj = p((self.n_heads + 2 * self.n_kv) * d, h)
        self.o_proj = p(h, self.n_heads * d)
        self.qkv_packed: torch.Tensor | None = None  # qkv_proj in oneDNN's layout (float32 CPU), set by load
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
            # q_norm's weight for each q head then k_norm's for each k head: q and k, adjacent in
            # qkv_proj's output, are normalised (and rotated) together, one op each instead of two
            self.register_buffer("qk_norm_weight", torch.empty(self.n_heads + self.n_kv, d, dtype=dtype),
                                 persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta, kv: KVCache) -> torch.Tensor:
        """cos, sin: [T, 1, head_dim] in x's dtype, from `Rotary` (sin signed)."""
        T, d = x.shape[0], self.cfg.head_dim
        qkv = linear(x, self.qkv_proj, self.qkv_packed)
        n_qk = self.n_heads + self.n_kv
        qk = qkv[:, : n_qk * d].view(T, n_qk, d)
        v = qkv[:, n_qk * d :].reshape(T, self.n_kv, d)
        if self.cfg.qk_norm:
            qk = rms_norm(qk, self.qk_norm_weight, self.cfg.rms_norm_eps)
        qk = qk * cos + torch.roll(qk, d // 2, -1) * sin
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        kv.write(self.layer, meta.slots, k, v)
        gqa = self.n_heads != self.n_kv
        if meta.decode and not batch_invariant(x.dtype):
            B = q.shape[0]
            # index_select of whole blocks is a plain memcpy (advanced indexing is several times slower)
            kb, vb = kv.gather_blocks(self.layer, meta.block_tables.reshape(-1))
            kc = kb.view(B, -1, self.n_kv, d).transpose(1, 2)  # [B, kv, ctx, d]
            vc = vb.view(B, -1, self.n_kv, d).transpose(1, 2)
            mask = meta.decode_mask
            if mask is None:
                mask = decode_mask(meta.context_lens, kc.shape[2])
            o = F.scaled_dot_product_attention(q.view(B, self.n_heads, 1, d), kc, vc, attn_mask=mask, enable_gqa=gqa)
            o = o.reshape(B, self.n_heads * d)
        else:
            outs, start = [], 0
            for i, qlen in enumerate(meta.query_lens):
                n_ctx = int(meta.context_lens[i])
                kk, vv = kv.gather(self.layer, meta.block_tables[i], n_ctx)
                qi = q[start : start + qlen].transpose(0, 1)  # [heads, qlen, d]
                qpos = torch.arange(n_ctx - qlen, n_ctx, device=x.device)
                mask = torch.arange(n_ctx, device=x.device)[None, :] <= qpos[:, None]
                oi = F.scaled_dot_product_attention(
                    qi, kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask, enable_gqa=gqa
                )
                outs.append(oi.transpose(0, 1).reshape(qlen, self.n_heads * d))
                start += qlen
            o = torch.cat(outs) if outs else x.new_empty((0, self.n_heads * d))
        return self.ps.tp_all_reduce(linear(o, self.o_proj))


class DenseMLP(torch.nn.Module):
    """Dense layers (Qwen3 mlp_only_layers) are small: every rank holds them whole."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, i = cfg.hidden_size, cfg.dense_intermediate_size
        self.gate_proj = torch.nn.Parameter(torch.empty(i, h, dtype=dtype), requires_grad=False)
        self.up_proj = torch.nn.Parameter(torch.empty(i, h, dtype=dtype), requires_grad=False)
        self.down_proj = torch.nn.Parameter(torch.empty(h, i, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj), self.down_proj)


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, layer: int, dtype: torch.dtype):
        super().__init__()
        self.ps = ps
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, ps, layer, dtype)
        self.mlp: torch.nn.Module = SparseMoE(cfg, ps, layer, dtype) if cfg.is_moe_layer(layer) else DenseMLP(cfg, dtype)

    def forward(self, x, cos, sin, meta, kv) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x), cos, sin, meta, kv)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, SparseMoE):
            return x + self._moe(h)
        return x + self.mlp(h)

    def _moe(self, h: torch.Tensor) -> torch.Tensor:
        tp = self.ps.layout.attn_tp
        if tp == 1:
            return self.mlp(h)
        # attention-TP ranks hold the same tokens: each dispatches its own contiguous share,
        # then the shares are summed back together (adding zeros is exact)
        T = h.shape[0]
        per = (T + tp - 1) // tp
        lo, hi = min(T, self.ps.tp_rank * per), min(T, (self.ps.tp_rank + 1) * per)
        out = torch.zeros_like(h)
        out[lo:hi] = self.mlp(h[lo:hi], token_offset=lo)
        return self.ps.tp_all_reduce(out)


class MoEModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.ps, self.dtype = cfg, ps, dtype
        self.embed_tokens = torch.nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, ps, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = torch.nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta, kv: KVCache,
                logits_at: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary(positions)
        cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)  # once per step, not per layer
        for layer in self.layers:
            x = layer(x, cos, sin, meta, kv)
        h = self.norm(x[logits_at])
        return linear(h, self.lm_head).float()

    # ---- weights -------------------------------------------------------
    def load(self, model_dir: Path) -> None:
        """Load only this rank's shard: its attention heads and its expert slots."""
        from relayout.engine.model.weights import load_weight_slice, load_weights

        cfg = self.cfg
        qwen = cfg.is_qwen3
        mlp = "mlp" if qwen else "block_sparse_moe"
        gate_n, up_n, down_n = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
        needed: set[str] = {"model.embed_tokens.weight", "model.norm.weight"}
        if not cfg.tie_word_embeddings:
            needed.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            needed |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            if cfg.qk_norm:
                needed |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
            if isinstance(layer.mlp, SparseMoE):
                needed.add(p + f"{mlp}.gate.weight")
                for e in set(layer.mlp.local_slots):
                    needed |= {p + f"{mlp}.experts.{e}.{n}.weight" for n in (gate_n, up_n, down_n)}
            else:
                needed |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        w = load_weights(model_dir, lambda name: name in needed)
        missing = needed - set(w)
        if missing:
            raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        d = cfg.head_dim
        with torch.no_grad():
            self.embed_tokens.copy_(w["model.embed_tokens.weight"])
            self.norm.weight.copy_(w["model.norm.weight"])
            self.lm_head.copy_(w["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"])
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.input_layernorm.weight.copy_(w[p + "input_layernorm.weight"])
                layer.post_attention_layernorm.weight.copy_(w[p + "post_attention_layernorm.weight"])
                a = layer.attn
                ql, qh = a.q_range
                kl, kh = a.kv_range
                a.qkv_proj.copy_(torch.cat([
                    load_weight_slice(model_dir, p + "self_attn.q_proj.weight", 0, ql * d, qh * d),
                    load_weight_slice(model_dir, p + "self_attn.k_proj.weight", 0, kl * d, kh * d),
                    load_weight_slice(model_dir, p + "self_attn.v_proj.weight", 0, kl * d, kh * d),
                ]))
                a.qkv_packed = pack_cpu_weight(a.qkv_proj)
                a.o_proj.copy_(load_weight_slice(model_dir, p + "self_attn.o_proj.weight", 1, ql * d, qh * d))
                if cfg.qk_norm:
                    a.q_norm.weight.copy_(w[p + "self_attn.q_norm.weight"])
                    a.k_norm.weight.copy_(w[p + "self_attn.k_norm.weight"])
                    a.qk_norm_weight.copy_(torch.cat([a.q_norm.weight.expand(a.n_heads, d),
                                                      a.k_norm.weight.expand(a.n_kv, d)]))
                m = layer.mlp
                if isinstance(m, SparseMoE):
                    m.router.copy_(w[p + f"{mlp}.gate.weight"])
                    il, ih = m.inter_range
                    for s, e in enumerate(m.local_slots):
                        q = p + f"{mlp}.experts.{e}."
                        m.experts.w_gate_up[s].copy_(torch.cat([w[q + f"{gate_n}.weight"][il:ih],
                                                                w[q + f"{up_n}.weight"][il:ih]]))
                        m.experts.w_down[s].copy_(w[q + f"{down_n}.weight"][:, il:ih])
                else:
                    for n in ("gate_proj", "up_proj", "down_proj"):
                        getattr(m, n).copy_(w[p + f"mlp.{n}.weight"])
