"""KV chunks: one safetensors payload (tensor "kv", [2, heads, tokens, head_dim]) run through a codec.

Chunks are content-addressed by the xxh3_128 of their STORED bytes, so identical chunks
(e.g. the unchanged prefix of a session in an incremental checkpoint) are stored once and
a corrupt chunk is caught before any decoding work is done.
"""

from __future__ import annotations

import json

import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from storage.codecs import decode, encode
from storage.errors import CorruptCheckpoint
from storage.manifest import ChunkRef

TENSOR_NAME = "kv"


def chunk_hash(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return found


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def _st_bytes(t: torch.Tensor) -> bytes:
    """safetensors.torch.save({"kv": t}) byte for byte, in one copy: the header, then the
    tensor's memory joined straight in (save() goes through a ~0.5 GB/s serialiser)."""
    code = _ST_DTYPES.get(t.dtype)
    if code is None:
        return st_save({TENSOR_NAME: t})
    n = t.numel() * t.element_size()
    head = json.dumps({TENSOR_NAME: {"dtype": code, "shape": list(t.shape), "data_offsets": [0, n]}},
                      separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8-byte alignment
    prefix = len(head).to_bytes(8, "little") + head
    # one copy, straight from the (possibly strided) tensor into the final buffer
    buf = bytearray(len(prefix) + n)
    buf[: len(prefix)] = prefix
    if n:
        torch.frombuffer(buf, dtype=torch.uint8, offset=len(prefix), count=n).view(t.dtype).view(t.shape).copy_(t)
    return buf  # type: ignore[return-value]  # bytes-like, spared the copy bytes() would make


def pack_kv(tensor: torch.Tensor, codec: str = "none") -> tuple[bytes, ChunkRef]:
    """Serialise a [2, heads, tokens, head_dim] tensor (any device) into stored chunk bytes."""
    if tensor.dim() != 4 or tensor.shape[0] != 2:
        raise ValueError(f"KV chunk tensor must be [2, heads, tokens, head_dim], got {list(tensor.shape)}")
    t = tensor.detach().to("cpu")
    raw = _st_bytes(t) if t.dtype in _ST_DTYPES else _st_bytes(t.contiguous())
    data = encode(codec, raw, tensor.element_size())
    ref = ChunkRef(hash=chunk_hash(data), size=len(data), raw_size=len(raw), codec=codec)  # type: ignore[arg-type]
    return data, ref


def verify_chunk(data: bytes, ref: ChunkRef) -> None:
    """Check stored bytes against their reference (size, then hash)."""
    if len(data) != ref.size:
        raise CorruptCheckpoint(f"chunk {ref.hash}: {len(data)} bytes stored, manifest says {ref.size}")
    actual = chunk_hash(data)
    if actual != ref.hash:
        raise CorruptCheckpoint(f"chunk {ref.hash}: hash mismatch (stored bytes hash to {actual})")


def unpack_kv(
    data: bytes,
    ref: ChunkRef,
    expect_shape: tuple[int, ...] | torch.Size,
    expect_dtype: torch.dtype | str,
) -> torch.Tensor:
    """Verify, decode and parse one chunk; any mismatch is ``CorruptCheckpoint`` naming the chunk."""
    verify_chunk(data, ref)  # hash first: never decode bytes we cannot vouch for
    dtype = _as_dtype(expect_dtype)
    try:
        raw = decode(ref.codec, data, ref.raw_size, torch.empty((), dtype=dtype).element_size())
    except CorruptCheckpoint as exc:
        raise CorruptCheckpoint(f"chunk {ref.hash}: {exc}") from None
    try:
        tensors = st_load(raw)
    except Exception as exc:  # safetensors raises its own (non-Storage) error types on bad headers
        raise CorruptCheckpoint(f"chunk {ref.hash}: not a valid safetensors payload ({exc})") from None
    if set(tensors) != {TENSOR_NAME}:
        raise CorruptCheckpoint(f"chunk {ref.hash}: expected one tensor {TENSOR_NAME!r}, found {sorted(tensors)}")
    t = tensors[TENSOR_NAME]
    if tuple(t.shape) != tuple(expect_shape):
        raise CorruptCheckpoint(f"chunk {ref.hash}: shape {list(t.shape)}, expected {list(expect_shape)}")
    if t.dtype != dtype:
        raise CorruptCheckpoint(f"chunk {ref.hash}: dtype {dtype_name(t.dtype)}, expected {dtype_name(dtype)}")
    return t
