"""Precision: chunks of every KV dtype stored exactly, the engine in bfloat16 against transformers,
and bfloat16 sessions that continue token-for-token after a checkpoint and restore."""

import pytest
import torch
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.chunks import kv_view, new_kv_chunk, pack_kv, unpack_kv
from relayout.storage.codecs import CODECS
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.manifest import KVGeometry, ModelRef
from relayout.storage.stores import MemoryStore
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def every_bit_pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random raw bits reinterpreted as `dtype`: NaNs, infinities and subnormals included, so only a
    byte-exact path round-trips them."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_chunk_round_trip_is_exact(dtype, codec):
    t = every_bit_pattern((2, 3, 37, 16), dtype)
    data, ref = pack_kv(t, codec)
    assert same_bits(unpack_kv(data, ref, t.shape, dtype), t)
    assert same_bits(kv_view(data, ref, t.shape, str(dtype).removeprefix("torch.")), t)
    # a strided source (a transposed view, as exports hand out) packs to the same bytes
    strided = t.transpose(2, 3).contiguous().transpose(2, 3)
    assert pack_kv(strided, codec)[0] == data
    # the stored payload is exactly what safetensors writes, and safetensors reads it back
    raw = bytes(data) if codec == "none" else None
    if raw is not None:
        assert raw == st_save({"kv": t.contiguous()})
        assert same_bits(st_load(raw)["kv"], t)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_prefilled_chunk_buffer_and_dtype_checks(dtype):
    src = every_bit_pattern((2, 2, 16, 8), dtype, seed=3)
    t = new_kv_chunk(src.shape, dtype)
    t.copy_(src)
    data, ref = pack_kv(t)
    assert bytes(data) == bytes(pack_kv(src.clone())[0])  # the one-copy buffer is the ordinary payload
    assert same_bits(unpack_kv(data, ref, src.shape, dtype), src)
    other = torch.bfloat16 if dtype != torch.bfloat16 else torch.float16
    with pytest.raises(CorruptCheckpoint, match="dtype|not a valid"):
        unpack_kv(data, ref, src.shape, other)
    tampered = bytearray(data)
    tampered[-1] ^= 1
    with pytest.raises(CorruptCheckpoint, match="hash mismatch"):
        unpack_kv(bytes(tampered), ref, src.shape, dtype)


@pytest.mark.parametrize("codec", ["none", "zstd-planes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_checkpoint_of_low_precision_kv(dtype, codec):
    """A whole checkpoint (manifest + chunks) of bf16 / fp8 KV reads back bit for bit, re-sliced."""
    store = MemoryStore()
    kv = every_bit_pattern((3, 2, 4, 40, 8), dtype, seed=5)  # [layers, 2, heads, tokens, d]
    with CheckpointWriter(store, "lowp", codec=codec) as w:
        for layer in range(3):
            for h0, h1 in ((0, 2), (2, 4)):
                for a, b in ((0, 32), (32, 40)):
                    w.put_kv("s", layer, h0, h1, a, b, kv[layer, :, h0:h1, a:b])
        w.add_session("s", {}, 40)
        w.commit(ModelRef(name="m", fingerprint="f", config={}), {},
                 KVGeometry(num_layers=3, num_kv_heads=4, head_dim=8, dtype=str(dtype).removeprefix("torch.")))
    r = CheckpointReader(store, "lowp")
    assert r.dtype == dtype and r.manifest.kv.itemsize == dtype.itemsize
    assert r.verify() > 0
    for layer in range(3):
        assert same_bits(r.read_kv("s", layer, 1, 3), kv[layer, :, 1:3].contiguous())
