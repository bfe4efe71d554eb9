"""Checkpoint format under hostile input: corruption, lying sizes, manifest cross-references, the
live-migration stream's failures, and fuzzed manifest and frame parsers (property tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relayout.storage.checkpoint import CheckpointReader
from relayout.storage.errors import (
    CheckpointNotFound,
    ChunkMissing,
    CorruptCheckpoint,
    ModelMismatch,
    StorageError,
)
from relayout.storage.format.chunks import pack_kv, unpack_kv
from relayout.storage.format.codecs import CODECS, decode, encode
from relayout.storage.format.manifest import MAX_MANIFEST_BYTES, ChunkRef, Manifest
from relayout.storage.stores import LocalStore, MemoryStore
from relayout.storage.stream import (
    FrameDecoder,
    LimitExceeded,
    StreamAborted,
    StreamReceiver,
    encode_abort_frame,
    encode_chunk_frame,
    iter_checkpoint_frames,
)

from tests.helpers.checkpoints import D, H, L, kv_tensor, write_checkpoint

# ---- corruption -----------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_flipped_byte_in_any_chunk_is_refused(tmp_path: Path, codec: str) -> None:
    store = LocalStore(tmp_path)
    m = write_checkpoint(store, "ck", {"s": kv_tensor(6, 7)}, codec=codec)
    for h in {e.chunk.hash for e in m.kv_entries}:
        path = tmp_path / "chunks" / h[:2] / h
        good = path.read_bytes()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptCheckpoint, match=h):
            CheckpointReader(store, "ck").verify()
        layer = next(e.layer for e in m.kv_entries if e.chunk.hash == h)
        with pytest.raises(CorruptCheckpoint, match=h):
            CheckpointReader(store, "ck").read_kv("s", layer, 0, H)
        path.write_bytes(good)
    CheckpointReader(store, "ck").verify()


def test_truncated_manifest_missing_chunk_wrong_model(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    m = write_checkpoint(store, "ck", {"s": kv_tensor(8, 5)})
    mpath = tmp_path / "manifests" / "ck.json"
    good = mpath.read_bytes()
    mpath.write_bytes(good[: len(good) // 2])
    with pytest.raises(CorruptCheckpoint, match="invalid manifest"):
        CheckpointReader(store, "ck")
    mpath.write_bytes(good)

    r = CheckpointReader(store, "ck")
    r.check_model("fp-1")
    with pytest.raises(ModelMismatch, match="fp-1"):
        r.check_model("fp-other")

    h = m.kv_entries[0].chunk.hash
    (tmp_path / "chunks" / h[:2] / h).unlink()
    with pytest.raises(ChunkMissing, match=h):
        r.verify()
    with pytest.raises(CheckpointNotFound):
        CheckpointReader(store, "nope")


def _tamper(store: MemoryStore, cid: str, fn) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(store.get_manifest(cid))
    fn(doc)
    store.put_manifest(cid, json.dumps(doc).encode())


def test_lying_sizes_are_refused() -> None:
    store = MemoryStore()
    write_checkpoint(store, "ck", {"s": kv_tensor(9, 6)}, codec="zstd")
    # A raw_size far beyond the tensor the entry describes is refused at parse time.
    _tamper(store, "ck", lambda d: d["kv_entries"][0]["chunk"].update(raw_size=2**39))
    with pytest.raises(CorruptCheckpoint, match="raw_size"):
        CheckpointReader(store, "ck")

    # A zstd frame that decodes to more than the declared raw_size is cut off, not buffered.
    bomb = encode("zstd", b"\0" * (64 * 1024 * 1024), 1)
    with pytest.raises(CorruptCheckpoint, match="67108864 bytes, declared 1000"):
        decode("zstd", bomb, 1000, 1)
    # Same without a content size in the frame header: the streaming path stops past raw_size.
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 * 1024 * 1024))
    with pytest.raises(CorruptCheckpoint, match="more than the declared 1000"):
        decode("zstd", bomb, 1000, 1)
    assert decode("zstd", zstandard.ZstdCompressor(write_content_size=False).compress(b"abc"), 3, 1) == b"abc"
    with pytest.raises(CorruptCheckpoint, match="decodes to"):
        decode("zstd", encode("zstd", b"abc", 1), 10, 1)
    # A chunk whose declared raw_size is slightly smaller than its payload.
    t = kv_tensor(10, 3)[0]
    data, ref = pack_kv(t, "zstd-planes")
    lie = ChunkRef(hash=ref.hash, size=ref.size, raw_size=ref.raw_size - 8, codec=ref.codec)
    with pytest.raises(CorruptCheckpoint, match=ref.hash):
        unpack_kv(data, lie, t.shape, t.dtype)
    with pytest.raises(CorruptCheckpoint, match="shape"):
        unpack_kv(data, ref, (2, 4, 2, D), t.dtype)
    with pytest.raises(CorruptCheckpoint, match=ref.hash):  # planes of the wrong width: garbage
        unpack_kv(data, ref, t.shape, torch.float16)
    data, ref = pack_kv(t, "none")
    with pytest.raises(CorruptCheckpoint, match="dtype float32, expected float16"):
        unpack_kv(data, ref, t.shape, torch.float16)


def test_manifest_cross_reference_checks() -> None:
    store = MemoryStore()
    write_checkpoint(store, "ck", {"s": kv_tensor(11, 4)})
    raw = store.get_manifest("ck")
    cases = {
        "undeclared session": lambda d: d["kv_entries"][0].update(session_id="ghost"),
        "layer outside": lambda d: d["kv_entries"][0].update(layer=L),
        "outside 4 KV heads": lambda d: d["kv_entries"][0].update(head_hi=H + 1),
        "beyond the session": lambda d: d["sessions"][0].update(num_kv_tokens=1),
        "declared twice": lambda d: d["sessions"].append(d["sessions"][0]),
        "Extra inputs": lambda d: d.update(evil=1),
        "format_version": lambda d: d.update(format_version=3),  # a version this reader does not know
        "checkpoint_id": lambda d: d.update(checkpoint_id="../etc"),
        "hash": lambda d: d["kv_entries"][0]["chunk"].update(hash="ZZ"),
        "greater than or equal": lambda d: d["kv_entries"][0]["chunk"].update(size=-1),
        "valid integer": lambda d: d["kv"].update(num_layers="2"),
    }
    for needle, fn in cases.items():
        doc = json.loads(raw)
        fn(doc)
        with pytest.raises(CorruptCheckpoint, match=needle):
            Manifest.parse(json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpoint, match="exceeds"):
        Manifest.parse(b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(CorruptCheckpoint):
        Manifest.parse(b"[" * 100_000)


def test_coverage_gap_detected_on_read_and_verify() -> None:
    store = MemoryStore()
    write_checkpoint(store, "ck", {"s": kv_tensor(12, 6)})
    _tamper(store, "ck", lambda d: d["kv_entries"].pop(1))  # layer 0, heads [0,2), middle tokens
    r = CheckpointReader(store, "ck")
    with pytest.raises(CorruptCheckpoint, match="not covered"):
        r.read_kv("s", 0, 0, 4)
    assert torch.equal(r.read_kv("s", 0, 2, 4), kv_tensor(12, 6)[0, :, 2:4])  # other heads are intact
    with pytest.raises(CorruptCheckpoint, match="incomplete"):
        r.verify()


# ---- stream ----------------------------------------------------------------------------------


def test_stream_round_trip_in_arbitrary_pieces() -> None:
    src = MemoryStore()
    kv = kv_tensor(15, 8, torch.bfloat16)
    m = write_checkpoint(src, "ck", {"s": kv}, codec="zstd-planes")
    wire = b"".join(iter_checkpoint_frames(src, "ck"))
    dst = MemoryStore()
    rx = StreamReceiver(dst)
    got = None
    for i in range(0, len(wire), 37):
        got = rx.feed(wire[i : i + 37]) or got
    assert got == m and rx.close() == m
    assert dst.list_checkpoints() == ["ck"]
    assert torch.equal(CheckpointReader(dst, "ck").read_kv("s", 1, 0, H), kv[1])


def _reader(wire: bytes, sizes: list[int]):
    """A read_into over `wire` that fills at most sizes[i % len] bytes per call (a socket's short reads)."""
    pos, calls = [0], [0]

    def read_into(view: memoryview) -> int:
        n = min(len(view), sizes[calls[0] % len(sizes)], len(wire) - pos[0])
        view[:n] = wire[pos[0] : pos[0] + n]
        pos[0] += n
        calls[0] += 1
        return n

    return read_into


def test_stream_read_into_mode_round_trip_and_failures() -> None:
    """receive_from (the frame link's read-into path) gives what feed gives, in any read sizes."""
    src = MemoryStore()
    kv = kv_tensor(15, 8, torch.bfloat16)
    m = write_checkpoint(src, "ck", {"s": kv}, codec="zstd-planes")
    wire = b"".join(iter_checkpoint_frames(src, "ck"))
    for sizes in ([1], [3, 4096, 7], [1 << 30]):
        dst = MemoryStore()
        rx = StreamReceiver(dst)
        assert rx.receive_from(_reader(wire, sizes)) == m and rx.bytes_received == len(wire)
        assert torch.equal(CheckpointReader(dst, "ck").read_kv("s", 1, 0, H), kv[1])
    with pytest.raises(CorruptCheckpoint, match="truncated|before its manifest"):  # the input ends early
        StreamReceiver(MemoryStore()).receive_from(_reader(wire[:-5], [999]))
    with pytest.raises(LimitExceeded):  # refused before reading past the limit
        StreamReceiver(MemoryStore()).receive_from(_reader(wire, [999]), limit=len(wire) - 1)
    with pytest.raises(StreamAborted, match="source died"):  # an empty payload completes without a read
        StreamReceiver(MemoryStore()).receive_from(_reader(encode_abort_frame("source died"), [5]))
    with pytest.raises(CorruptCheckpoint, match="magic"):
        StreamReceiver(MemoryStore()).receive_from(_reader(b"EVIL" + bytes(64), [64]))


def test_stream_precopy_skip_and_failures() -> None:
    src = MemoryStore()
    m = write_checkpoint(src, "ck", {"s": kv_tensor(16, 6)})
    hashes = [e.chunk.hash for e in m.kv_entries]
    # Pre-copy: target already holds the first chunk; the final stream skips it.
    dst = MemoryStore()
    dst.put_chunk(hashes[0], src.get_chunk(hashes[0]))
    rx = StreamReceiver(dst)
    assert rx.feed(b"".join(iter_checkpoint_frames(src, "ck", skip={hashes[0]}))) == m
    # Without it, the manifest is refused and nothing is committed.
    dst2 = MemoryStore()
    with pytest.raises(ChunkMissing, match=hashes[0]):
        StreamReceiver(dst2).feed(b"".join(iter_checkpoint_frames(src, "ck", skip={hashes[0]})))
    assert dst2.list_checkpoints() == []
    # A chunk whose payload does not match its hash.
    ref = m.kv_entries[0].chunk
    data = bytearray(src.get_chunk(ref.hash))
    data[-1] ^= 0xFF
    with pytest.raises(CorruptCheckpoint, match=ref.hash):
        StreamReceiver(MemoryStore()).feed(encode_chunk_frame(ref, bytes(data)))
    # Abort and truncation.
    with pytest.raises(StreamAborted, match="source died"):
        StreamReceiver(MemoryStore()).feed(encode_abort_frame("source died"))
    rx = StreamReceiver(MemoryStore())
    rx.feed(encode_chunk_frame(ref, src.get_chunk(ref.hash))[:-3])
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        rx.close()


def test_frame_decoder_limits() -> None:
    dec = FrameDecoder(max_frame_bytes=1000)
    with pytest.raises(CorruptCheckpoint, match="magic"):
        dec.feed(b"EVIL")
    with pytest.raises(CorruptCheckpoint):  # stays broken
        dec.feed(b"")
    big = b"RLC1" + (2**62).to_bytes(8, "big")
    with pytest.raises(CorruptCheckpoint, match="exceeds"):
        FrameDecoder(1000).feed(big)
    dec = FrameDecoder(1000)
    assert dec.feed(b"RL") == [] and not dec.at_boundary


# ---- property tests: parsers raise only StorageError, within limits --------------------------

_VALID_MANIFEST: bytes | None = None
_VALID_WIRE: bytes | None = None


def _samples() -> tuple[bytes, bytes]:
    global _VALID_MANIFEST, _VALID_WIRE
    if _VALID_MANIFEST is None:
        s = MemoryStore()
        write_checkpoint(s, "ck", {"s": kv_tensor(17, 3)}, tok_splits=1)
        _VALID_MANIFEST = s.get_manifest("ck")
        _VALID_WIRE = b"".join(iter_checkpoint_frames(s, "ck"))
    assert _VALID_WIRE is not None
    return _VALID_MANIFEST, _VALID_WIRE


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(data)
    for pos, val in edits:
        b[pos % len(b)] = val
    return bytes(b[:cut] if cut is not None else b)


_edits = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8)
_PROP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_PROP
@given(st.one_of(st.binary(max_size=512), st.tuples(_edits, st.one_of(st.none(), st.integers(0, 4000)))))
def test_manifest_parse_never_raises_anything_else(sample) -> None:  # type: ignore[no-untyped-def]
    data = sample if isinstance(sample, bytes) else _mutate(_samples()[0], *sample)
    try:
        m = Manifest.parse(data)
    except StorageError:
        return
    assert isinstance(m, Manifest)


@_PROP
@given(
    st.one_of(st.binary(max_size=512), st.tuples(_edits, st.one_of(st.none(), st.integers(0, 100_000)))),
    st.integers(1, 4096),
)
def test_frame_decoder_and_receiver_never_raise_anything_else(sample, piece: int) -> None:  # type: ignore[no-untyped-def]
    data = sample if isinstance(sample, bytes) else _mutate(_samples()[1], *sample)
    limit = 64 * 1024
    dec = FrameDecoder(max_frame_bytes=limit)
    rx = StreamReceiver(MemoryStore(), max_frame_bytes=limit)
    try:
        for i in range(0, len(data), piece):
            for f in dec.feed(data[i : i + piece]):
                assert len(f.payload) <= limit
            assert len(dec._buf) <= limit + 12 + piece  # never buffers beyond one frame
    except StorageError:
        pass
    try:
        for i in range(0, len(data), piece):
            rx.feed(data[i : i + piece])
        rx.close()
    except StorageError:
        pass
