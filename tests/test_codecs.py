"""Chunk codecs: zstd-planes round trips for every element size, chunks of the earlier single-frame
layout still decode, corrupt or lying input is refused, and the ratio is no worse than before."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format import codecs
from relayout.storage.format.chunks import chunk_hash, pack_kv, unpack_kv
from relayout.storage.format.codecs import CODECS, PLANES_MARK, decode, encode, measure_codecs
from relayout.storage.format.manifest import ChunkRef


def old_zstd_planes(raw: bytes, itemsize: int) -> bytes:
    """zstd-planes as written before the per-plane layout: shuffle the whole buffer, one zstd frame."""
    if itemsize > 1 and len(raw) % itemsize == 0:
        raw = np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize).T.tobytes()
    return zstandard.ZstdCompressor(level=1).compress(raw)


def kv_like(dtype: torch.dtype, seed: int = 0, heads: int = 4, tokens: int = 256, dim: int = 64) -> bytes:
    """[2, heads, tokens, dim] of KV-like values: K random, V rows repeating as a layer-0 V does for
    repeated tokens (a vocabulary of 40 rows), in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(heads, tokens, dim, generator=g) * 2
    vocab = torch.randn(heads, 40, dim, generator=g)
    v = vocab[:, torch.randint(0, 40, (tokens,), generator=g)]
    return torch.stack([k, v]).to(dtype).contiguous().view(torch.uint8).numpy().tobytes()


def records(data: bytes, count: int) -> list[tuple[int, int]]:
    """(mode, stored length) of the first `count` plane records of a zstd-planes chunk (0 raw, 1 zstd)."""
    assert data[0] == PLANES_MARK
    return [struct.unpack_from("<BI", data, 6 + 5 * r) for r in range(count)]


# ---- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 1000, 1001, 1003, 65536 * 3 + 1, 1 << 20])
def test_zstd_planes_round_trip_any_size(itemsize: int, n: int) -> None:
    raw = np.random.default_rng(n).integers(0, 6, n, dtype=np.uint8).tobytes()
    data = encode("zstd-planes", raw, itemsize)
    assert data[0] == PLANES_MARK
    assert bytes(decode("zstd-planes", data, n, itemsize)) == raw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_zstd_planes_round_trip_kv_in_many_blocks(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    raw = kv_like(dtype) + b"\x07\x01\x02"  # plus a tail that fills no element
    itemsize = torch.empty((), dtype=dtype).element_size()
    monkeypatch.setattr(codecs, "BLOCK_ELEMENTS", 10_000)  # several blocks, the last one short
    data = encode("zstd-planes", raw, itemsize)
    monkeypatch.undo()  # the block size is read from the chunk, not from the decoder's constant
    assert bytes(decode("zstd-planes", data, len(raw), itemsize)) == raw


def test_chunks_round_trip_through_pack_kv() -> None:
    t = torch.randn(2, 3, 17, 8).to(torch.bfloat16)
    data, ref = pack_kv(t, "zstd-planes")
    assert ref.codec == "zstd-planes" and data[0] == PLANES_MARK
    assert torch.equal(unpack_kv(data, ref, t.shape, t.dtype), t)


# ---- the earlier layout ------------------------------------------------------------------------

# old_zstd_planes(np.linspace(-2, 2, 24, dtype="<f4").tobytes(), 4), as that code wrote it
OLD_SAMPLE = bytes.fromhex(
    "28b52ffd206001030000386fa7df169c0b7ad3b24343b2d37a0b9c16dfa76f380000bd7a37f4b2de59d39b901616909bd359deb2"
    "f4377abd0000e9d3bda69074481bde85b2b285de1b487490a6bdd3e900c0bfbfbfbfbfbfbfbfbebebd3d3e3e3f3f3f3f3f3f3f3f40"
)


def test_earlier_layout_still_decodes() -> None:
    raw = np.linspace(-2, 2, 24, dtype="<f4").tobytes()
    assert old_zstd_planes(raw, 4) == OLD_SAMPLE  # the helper is that code
    assert bytes(decode("zstd-planes", OLD_SAMPLE, len(raw), 4)) == raw
    for itemsize in (1, 2, 4):
        for n in (0, 7, 4096, 4099):
            raw = np.random.default_rng(n).integers(0, 9, n, dtype=np.uint8).tobytes()
            assert bytes(decode("zstd-planes", old_zstd_planes(raw, itemsize), n, itemsize)) == raw


def test_earlier_layout_chunk_restores_through_unpack_kv() -> None:
    t = torch.randn(2, 4, 33, 8)
    raw, _ = pack_kv(t, "none")
    data = old_zstd_planes(bytes(raw), 4)
    ref = ChunkRef(hash=chunk_hash(data), size=len(data), raw_size=len(raw), codec="zstd-planes")
    assert torch.equal(unpack_kv(data, ref, t.shape, t.dtype), t)


# ---- hostile input -----------------------------------------------------------------------------


def test_corrupt_or_lying_planes_refused() -> None:
    raw = kv_like(torch.float32, tokens=64)
    good = bytes(encode("zstd-planes", raw, 4))
    assert bytes(decode("zstd-planes", good, len(raw), 4)) == raw
    bad_cases = {
        "empty": b"",
        "header cut": good[:3],
        "records cut": good[:8],
        "no planes": good[: 6 + 5 * 4],
        "one byte short": good[:-1],
        "one byte more": good + b"\0",
        "zero planes": good[:1] + b"\0" + good[2:],
        "17 planes": good[:1] + b"\x11" + good[2:],
        "zero block": good[:2] + struct.pack("<I", 0) + good[6:],
        "tiny blocks": good[:2] + struct.pack("<I", 1) + good[6:],  # more records than bytes
        "unknown mode": good[:6] + b"\x07" + good[7:],
    }
    for name, data in bad_cases.items():
        with pytest.raises(CorruptCheckpoint):
            decode("zstd-planes", data, len(raw), 4)
            pytest.fail(name)
    for raw_size in (0, len(raw) - 4, len(raw) - 1, len(raw) + 1, len(raw) + 4, 10 * len(raw), 2**40):
        with pytest.raises(CorruptCheckpoint):
            decode("zstd-planes", good, raw_size, 4)
    flipped = bytearray(good)
    zstd_at = [i for i in range(len(good) - 3) if good[i : i + 4] == b"\x28\xb5\x2f\xfd"]
    assert zstd_at, "a KV sign/exponent plane is compressed"
    # the last frame: the sign/exponent plane, Huffman-coded (a noise plane's frame may keep its
    # literals raw, where a flipped byte decodes to another byte: the chunk's hash catches that)
    flipped[zstd_at[-1] + 20] ^= 0xFF
    with pytest.raises(CorruptCheckpoint):
        decode("zstd-planes", bytes(flipped), len(raw), 4)


def test_plane_frame_cannot_decode_past_its_plane() -> None:
    # one plane, "compressed", whose frame claims (or streams) far more than the plane holds
    for frame in (zstandard.ZstdCompressor().compress(b"\0" * (64 << 20)),
                  zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20))):
        data = bytes([PLANES_MARK, 1]) + struct.pack("<I", 1 << 19) + struct.pack("<BI", 1, len(frame)) + frame
        with pytest.raises(CorruptCheckpoint):
            decode("zstd-planes", data, 1000, 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 5000), st.sampled_from([1, 2, 4]))
def test_any_bytes_decode_to_raw_size_or_refused(tail: bytes, raw_size: int, itemsize: int) -> None:
    for data in (bytes([PLANES_MARK]) + tail, tail):
        try:
            out = decode("zstd-planes", data, raw_size, itemsize)
        except CorruptCheckpoint:
            continue
        assert len(out) == raw_size


# ---- ratio and work ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bf16-precision", "bfloat16"])
def test_ratio_no_worse_than_earlier_layout(dtype: str) -> None:
    torch_dtype = torch.bfloat16 if dtype != "float32" else torch.float32
    size = 0
    old = new = 0
    for seed in range(3):
        raw = kv_like(torch_dtype, seed)
        if dtype == "bf16-precision":  # float32 values of bf16 precision: two all-zero planes
            raw = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float().numpy().tobytes()
        itemsize = 2 if dtype == "bfloat16" else 4
        size += len(raw)
        old += len(old_zstd_planes(raw, itemsize))
        new += len(encode("zstd-planes", raw, itemsize))
    assert size / new >= size / old, (size / old, size / new)


def test_noise_planes_stored_raw_sign_exponent_compressed() -> None:
    raw = kv_like(torch.float32, tokens=1024)  # 2 MiB, one block of 512 Ki elements
    data = bytes(encode("zstd-planes", raw, 4))
    assert data[1] == 4 and struct.unpack_from("<I", data, 2)[0] == codecs.BLOCK_ELEMENTS
    # every byte of a float but the top one is noise in K but repeats in V (rows of a small
    # vocabulary): worth zstd's matches; the top byte (sign and exponent) compresses by its histogram
    assert [mode for mode, _ in records(data, 4)] == [1, 1, 1, 1]
    rand = np.random.default_rng(1).standard_normal(len(raw) // 4).astype("<f4").tobytes()
    got = records(bytes(encode("zstd-planes", rand, 4)), 4)
    assert [mode for mode, _ in got] == [0, 0, 0, 1]  # noise: stored as it is, no zstd pass
    assert got[3][1] < len(rand) // 4 / 2


def test_measure_codecs_reports_each_direction() -> None:
    raw = kv_like(torch.float32, tokens=32)
    r = measure_codecs(raw, 4)
    assert set(r) == set(CODECS)
    for v in r.values():
        assert v["encode_gbps"] > 0 and v["decode_gbps"] > 0 and v["gbps"] > 0
    assert r["zstd-planes"]["ratio"] >= r["zstd"]["ratio"]


def test_one_byte_values_one_dense_frame_decoded_without_copy() -> None:
    # fp8: one plane, compressed by the dense coder straight away (no trial on a sample)
    raw = kv_like(torch.float8_e4m3fn, tokens=1024)
    data = bytes(encode("zstd-planes", raw, 1))
    (mode, size), = records(data, 1)
    _, dense, _ = codecs._coders()
    assert mode == 1 and data[-size:] == dense.compress(raw)
    out = decode("zstd-planes", data, len(raw), 1)
    assert type(out) is bytes and out == raw  # zstd's own output, not copied into a new buffer
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    data = bytes(encode("zstd-planes", noise, 1))
    assert records(data, 1) == [(0, len(noise))] and bytes(decode("zstd-planes", data, len(noise), 1)) == noise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_threads_round_trip_through_plain_decoder(dtype: torch.dtype) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = kv_like(dtype, tokens=2 * 2**21 // (2 * 4 * 64) + 7)  # > 2 Mi elements: a second block
    data = bytes(encode("zstd-planes", raw, itemsize, threads=2))
    assert struct.unpack_from("<I", data, 2)[0] == codecs._MT_BLOCK_ELEMENTS
    assert any(mode == 1 and size > 0 for mode, size in records(data, 2 * itemsize))
    assert bytes(decode("zstd-planes", data, len(raw), itemsize)) == raw
    big = raw * 2  # plain zstd too
    assert decode("zstd", encode("zstd", big, itemsize, threads=2), len(big), itemsize) == big
