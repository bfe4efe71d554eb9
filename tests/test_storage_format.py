"""Checkpoint format: round trips, re-slicing, incremental sharing, corruption, safety."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.chunks import chunk_hash, pack_kv, unpack_kv
from relayout.storage.codecs import CODECS, decode, encode, measure_codecs
from relayout.storage.errors import (
    CheckpointNotFound,
    ChunkMissing,
    CorruptCheckpoint,
    ModelMismatch,
    StorageError,
)
from relayout.storage.manifest import MAX_MANIFEST_BYTES, ChunkRef, KVGeometry, Manifest, ModelRef
from relayout.storage.stores import LocalStore, MemoryStore, Store, open_store
from relayout.storage.stream import (
    FrameDecoder,
    StreamAborted,
    StreamReceiver,
    encode_abort_frame,
    encode_chunk_frame,
    iter_checkpoint_frames,
)

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


# ---- round trips and re-slicing ------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_each_codec(tmp_path: Path, codec: str, dtype: torch.dtype) -> None:
    store = LocalStore(tmp_path)
    kv = kv_tensor(0, 10, dtype)
    m = write_checkpoint(store, "ck1", {"s1": kv}, codec=codec)
    assert store.list_checkpoints() == ["ck1"]
    r = CheckpointReader(store, "ck1")
    assert r.manifest == m
    assert r.manifest.session("s1").state == {"prompt": [1, 2, 3], "generated": [4]}
    assert r.verify() > 0
    for layer in range(L):
        assert torch.equal(r.read_kv("s1", layer, 0, H), kv[layer])


def test_reslice_heads_and_tokens_exact() -> None:
    store = MemoryStore()
    kv = kv_tensor(1, 11)
    write_checkpoint(store, "ck", {"a": kv, "b": kv_tensor(2, 5)})
    r = CheckpointReader(store, "ck")
    for layer in range(L):
        assert torch.equal(r.read_kv("a", layer, 1, 3), kv[layer, :, 1:3])  # spans both source ranges
        assert torch.equal(r.read_kv("a", layer, 0, 4), kv[layer])  # attn_tp=1 reader
        for h in range(H):  # attn_tp=4 readers
            assert torch.equal(r.read_kv("a", layer, h, h + 1), kv[layer, :, h : h + 1])


def test_read_fetches_each_chunk_once() -> None:
    store = MemoryStore()
    kv = torch.zeros(L, 2, H, 6, D)  # all chunks identical → one stored chunk, many entries
    write_checkpoint(store, "ck", {"a": kv})
    assert store.chunk_count == 1
    calls: list[str] = []
    orig = store.get_chunk
    store.get_chunk = lambda h: (calls.append(h), orig(h))[1]  # type: ignore[method-assign]
    assert torch.equal(CheckpointReader(store, "ck").read_kv("a", 0, 0, 4), kv[0])
    assert len(calls) == 1


def test_read_kv_ranges_shares_fetches_across_ranks() -> None:
    store = MemoryStore()
    kv = kv_tensor(20, 6)
    write_checkpoint(store, "ck", {"a": kv})
    calls: list[str] = []
    orig = store.get_chunk
    store.get_chunk = lambda h: (calls.append(h), orig(h))[1]  # type: ignore[method-assign]
    outs = CheckpointReader(store, "ck").read_kv_ranges("a", 1, [(h, h + 1) for h in range(H)])
    for h, out in enumerate(outs):
        assert torch.equal(out, kv[1, :, h : h + 1])
    assert len(calls) == len(set(calls)) == 2 * 3  # 2 head ranges × 3 token ranges, once each


def test_concurrent_put_kv_and_state_must_be_json() -> None:
    from concurrent.futures import ThreadPoolExecutor

    store = MemoryStore()
    kv = kv_tensor(21, 16)
    w = CheckpointWriter(store, "ck", codec="zstd")
    jobs = [(layer, h, t) for layer in range(L) for h in range(H) for t in range(0, 16, 4)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda j: w.put_kv("s", j[0], j[1], j[1] + 1, j[2], j[2] + 4, kv[j[0], :, j[1] : j[1] + 1, j[2] : j[2] + 4]), jobs))
    with pytest.raises(ValueError, match="plain JSON"):
        w.add_session("s", {"x": float("nan")}, 16)
    with pytest.raises(ValueError, match="plain JSON"):
        w.add_session("s", {"x": object()}, 16)
    w.add_session("s", {"rng": (1, 2)}, 16)
    m = w.commit(MODEL, LAYOUT, KVGeometry(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32"))
    assert len(m.kv_entries) == len(jobs) and m.sessions[0].state == {"rng": [1, 2]}
    assert torch.equal(CheckpointReader(store, "ck").read_kv("s", 1, 0, H), kv[1])


def test_zero_token_session_and_empty_checkpoint() -> None:
    store = MemoryStore()
    w = CheckpointWriter(store, "empty")
    w.add_session("idle", {"x": 1}, 0)
    w.commit(MODEL, LAYOUT, KVGeometry(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32"))
    r = CheckpointReader(store, "empty")
    assert r.read_kv("idle", 1, 0, H).shape == (2, H, 0, D)
    assert r.verify() == 0


def test_incremental_checkpoint_shares_chunks(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    kv = kv_tensor(3, 9)
    m1 = write_checkpoint(store, "ck1", {"s": kv})
    n1 = len(list(store._iter_chunks()))
    # Second checkpoint: same prefix token ranges + one new session.
    m2 = write_checkpoint(store, "ck2", {"s": kv, "t": kv_tensor(4, 9)})
    n2 = len(list(store._iter_chunks()))
    assert n2 == n1 + len({e.chunk.hash for e in m2.kv_entries if e.session_id == "t"})
    shared = {e.chunk.hash for e in m1.kv_entries}
    # Deleting ck1 keeps every chunk ck2 still references.
    store.delete_checkpoint("ck1")
    assert store.list_checkpoints() == ["ck2"]
    assert all(store.has_chunk(h) for h in shared)
    CheckpointReader(store, "ck2").verify()
    store.delete_checkpoint("ck2")
    assert list(store._iter_chunks()) == []
    with pytest.raises(CheckpointNotFound):
        store.delete_checkpoint("ck2")


def test_writer_progress_and_incomplete_commit_refused() -> None:
    store = MemoryStore()
    seen: list[int] = []
    w = CheckpointWriter(store, "ck", progress=seen.append)
    kv = kv_tensor(5, 4)
    w.put_kv("s", 0, 0, 4, 0, 4, kv[0])
    w.add_session("s", {}, 4)  # layer 1 never written
    assert seen == [w.bytes_written] and w.bytes_written > 0
    with pytest.raises(ValueError, match="session s layer 1"):
        w.commit(MODEL, LAYOUT, KVGeometry(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32"))
    assert store.list_checkpoints() == []
    with pytest.raises(ValueError, match="shape"):
        w.put_kv("s", 1, 0, 2, 0, 4, kv[1])


def test_zstd_planes_beats_zstd_on_bf16_precision_floats() -> None:
    g = torch.Generator().manual_seed(7)
    t = torch.randn(2, 4, 512, 64, generator=g)
    t = t.to(torch.bfloat16).to(torch.float32)  # low mantissa bytes are now zero
    raw = t.numpy().tobytes()
    r = measure_codecs(raw, 4)
    assert r["none"]["ratio"] == pytest.approx(1.0)
    assert r["zstd"]["ratio"] > 1.0
    assert r["zstd-planes"]["ratio"] > r["zstd"]["ratio"] * 1.1
    assert all(v["gbps"] > 0 for v in r.values())


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
        "format_version": lambda d: d.update(format_version=2),
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


# ---- visibility, ids, URIs, cleanup ------------------------------------------------------------


def test_incomplete_checkpoint_never_listed_and_cleaned(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    w = CheckpointWriter(store, "half")
    w.put_kv("s", 0, 0, 4, 0, 3, kv_tensor(13, 3)[0])
    (tmp_path / "tmp" / "stale.tmp").write_bytes(b"partial")
    assert store.list_checkpoints() == []
    with pytest.raises(CheckpointNotFound):
        store.get_manifest("half")
    # Pinned by the open writer: not collected even when old enough.
    assert store.cleanup_incomplete(max_age_s=-1) == 1  # only the stale temp file
    w.abort()
    assert store.cleanup_incomplete(max_age_s=3600) == 0  # too recent
    assert store.cleanup_incomplete(max_age_s=-1) == 1
    assert list(store._iter_chunks()) == [] and list((tmp_path / "tmp").iterdir()) == []


def test_writer_context_manager_aborts_on_error() -> None:
    store = MemoryStore()
    with pytest.raises(RuntimeError), CheckpointWriter(store, "ck") as w:
        w.put_kv("s", 0, 0, 4, 0, 2, kv_tensor(14, 2)[0])
        raise RuntimeError("source died")
    assert store.list_checkpoints() == [] and store.cleanup_incomplete(max_age_s=-1) == 1


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".hidden", "a" * 200, "x\x00y", "ok id"])
def test_traversal_ids_refused(tmp_path: Path, bad: str) -> None:
    store = LocalStore(tmp_path)
    with pytest.raises(ValueError):
        store.put_manifest(bad, b"{}")
    with pytest.raises(ValueError):
        store.get_manifest(bad)
    with pytest.raises(ValueError):
        CheckpointWriter(store, bad)
    with pytest.raises(ValueError):
        store.get_chunk("../" + "0" * 29)
    assert not any(p.name.startswith("x") for p in tmp_path.parent.iterdir() if p != tmp_path)


def test_open_store_uris(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "link")
    assert isinstance(open_store(f"file://{root}/ck", allowed_roots=[root]), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}/anywhere"), LocalStore)  # no roots: any path
    for uri in [
        f"file://{root}/../outside",
        f"file://{root}/%2e%2e/outside",
        f"file://{root}/link",  # symlink escape
        "file://relative/path",
        "file:relative",
        "http://example.com/x",
        "memory://",
        "s3://UPPER/x",
        "s3://bucket/../x",
        "s3://b",
        "/plain/path",
    ]:
        with pytest.raises(ValueError):
            open_store(uri, allowed_roots=[root])
    s3 = open_store("s3://my-bucket/some/prefix/")
    assert (s3.bucket, s3.prefix) == ("my-bucket", "some/prefix")  # type: ignore[attr-defined]


def test_put_chunk_checks_hash_and_is_idempotent(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    data = b"hello"
    h = chunk_hash(data)
    with pytest.raises(CorruptCheckpoint):
        store.put_chunk(h, b"hellO")
    store.put_chunk(h, data)
    old = time.time() - 7200
    os.utime(tmp_path / "chunks" / h[:2] / h, (old, old))
    store.put_chunk(h, data)  # present: no rewrite, but marked recently used
    assert store.get_chunk(h) == data
    assert store.cleanup_incomplete(max_age_s=3600) == 0


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
