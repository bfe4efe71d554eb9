"""Model configuration: one normalised view of the HF configs we support."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


class ModelConfigError(ValueError):
    pass


# weights and activations; the default is bfloat16 on CUDA, float32 on the CPU (names: torch's)
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# KV cache: "auto" is the model dtype; fp8_e4m3 stores K and V as float8 with per-block-per-head scales
KV_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3")


def check_dtype(name: str | None) -> str | None:
    """`name` checked against DTYPES (None stays None: the device's default). Torch-free, for
    front ends that validate before anything loads."""
    if name is not None and name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return name


def parse_dtype(name: str | torch.dtype | None, device: torch.device | str | None = None) -> torch.dtype:
    """The model dtype `name` names (None: bfloat16 on CUDA, float32 elsewhere); ValueError naming
    the allowed values otherwise."""
    import torch

    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    if name is None:
        return torch.bfloat16 if torch.device(device or "cpu").type == "cuda" else torch.float32
    return getattr(torch, check_dtype(name))  # type: ignore[arg-type]


def parse_kv_dtype(name: str | None) -> str:
    """`name` checked against KV_DTYPES (None: "auto")."""
    name = name or "auto"
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; allowed: {', '.join(KV_DTYPES)}")
    return name


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3 normalises q and k per head; Mixtral does not
    dense_layers: tuple[int, ...] = field(default_factory=tuple)  # layers with a dense MLP
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    @property
    def is_qwen3(self) -> bool:
        return self.architecture == "Qwen3MoeForCausalLM"

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def kv_bytes_per_token(self) -> int:
        # float32 K and V for every layer
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            mt = hf.get("model_type")
            arch = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}.get(mt)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rope_type not in ("default", None):
            raise ModelConfigError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
        is_qwen3 = arch == "Qwen3MoeForCausalLM"
        # Missing keys take the transformers defaults of the architecture, which differ.
        default_theta, default_eps, default_max_pos = (
            (10000.0, 1e-6, 32768) if is_qwen3 else (1e6, 1e-5, 131072)
        )
        rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or default_theta)
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        if is_qwen3 and hf.get("attention_bias"):
            raise ModelConfigError("attention_bias=true is not supported")
        # transformers applies a sliding window to Mixtral whenever sliding_window is set, and to
        # Qwen3-MoE only with use_sliding_window; we implement full attention only, so refuse
        # rather than silently differ once a context grows past the window.
        window = hf.get("sliding_window") if (not is_qwen3 or hf.get("use_sliding_window")) else None
        max_pos = int(hf.get("max_position_embeddings") or default_max_pos)
        if window is not None and int(window) < max_pos:
            raise ModelConfigError(f"sliding_window={window} is not supported (only full attention)")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        eos = hf.get("eos_token_id")
        eos_t = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_layers = int(hf["num_hidden_layers"])
        if is_qwen3:
            num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
            step = int(hf.get("decoder_sparse_step", 1) or 1)
            mlp_only = set(hf.get("mlp_only_layers") or [])
            dense = tuple(
                i for i in range(num_layers) if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0)
            )
            moe_inter = int(hf["moe_intermediate_size"])
            dense_inter = int(hf.get("intermediate_size", moe_inter))
            norm_topk = bool(hf.get("norm_topk_prob", False))
            qk_norm = True
        else:
            num_experts = int(hf["num_local_experts"])
            dense = ()
            moe_inter = int(hf["intermediate_size"])
            dense_inter = moe_inter
            norm_topk = True
            qk_norm = False
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            num_experts=num_experts,
            top_k=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=moe_inter,
            dense_intermediate_size=dense_inter,
            norm_topk_prob=norm_topk,
            rms_norm_eps=float(hf.get("rms_norm_eps") or default_eps),
            rope_theta=rope_theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            dense_layers=dense,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_t,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ModelConfigError(f"{path}: no config.json (expected a Hugging Face model directory)")
        return cls.from_hf(json.loads(p.read_text()))
