"""Checkpoint format: round trips, re-slicing, incremental sharing, visibility, ids, URIs, cleanup.

Corruption, the stream's failures and the fuzzed parsers are in test_storage_format_hostile.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.errors import (
    CheckpointNotFound,
    CorruptCheckpoint,
)
from relayout.storage.format.chunks import chunk_hash
from relayout.storage.format.codecs import CODECS, measure_codecs
from relayout.storage.format.manifest import KVGeometry
from relayout.storage.stores import LocalStore, MemoryStore, open_store

from tests.helpers.checkpoints import LAYOUT, MODEL, D, H, L, kv_tensor, write_checkpoint

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


# ---- delta rounds (a protection stream) ---------------------------------------------------------


def _delta(store: MemoryStore, kv: torch.Tensor, kv_from: int) -> tuple[CheckpointWriter, KVGeometry]:
    """A writer of one delta round: the session's KV from `kv_from` on only."""
    w = CheckpointWriter(store, "round-2", kv_from={"s": kv_from})
    for layer in range(L):
        w.put_kv("s", layer, 0, H, kv_from, kv.shape[3], kv[layer, :, :, kv_from:])
    w.add_session("s", {"prompt": [1], "generated": [2]}, kv.shape[3])
    return w, KVGeometry(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")


def test_delta_round_lists_only_new_kv_and_is_never_a_checkpoint() -> None:
    """A protection round's manifest lists each session's KV from what the standby holds on
    (kv_from), so it does not grow with the rounds; coverage counts from kv_from for a stream's
    receiver, from token 0 for a reader: a delta cannot be restored as if it were a checkpoint."""
    store = MemoryStore()
    kv = kv_tensor(7, 12)
    w, geo = _delta(store, kv, 8)
    m = w.commit(MODEL, LAYOUT, geo)
    assert m.session("s").kv_from == 8
    assert all(e.tok_lo >= 8 for e in m.kv_entries)
    assert m.coverage_error(from_kv_from=True) is None
    assert "tokens from 0 not covered" in (m.coverage_error() or "")
    with pytest.raises(CorruptCheckpoint, match="incomplete"):
        CheckpointReader(store, "round-2").verify()
    with pytest.raises(CorruptCheckpoint, match="not covered"):
        CheckpointReader(store, "round-2").read_kv("s", 0, 0, H)
    # a whole checkpoint's manifest does not even name the field: byte-for-byte what 0.3 wrote
    full = write_checkpoint(MemoryStore(), "ck", {"s": kv})
    assert b"kv_from" not in full.to_bytes() and all(x.kv_from == 0 for x in full.sessions)
    assert b'"kv_from":8' in m.to_bytes()


def test_delta_round_checks_its_own_coverage_and_bounds() -> None:
    store = MemoryStore()
    kv = kv_tensor(8, 12)
    w = CheckpointWriter(store, "round-3", kv_from={"s": 4})
    for layer in range(L):
        w.put_kv("s", layer, 0, H, 6, 12, kv[layer, :, :, 6:])  # tokens 4-5 missing
    w.add_session("s", {}, 12)
    with pytest.raises(ValueError, match=r"need \[4,12\)"):
        w.commit(MODEL, LAYOUT, KVGeometry(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32"))
    w, geo = _delta(MemoryStore(), kv, 8)
    m = w.commit(MODEL, LAYOUT, geo)
    raw = m.model_dump()
    raw["sessions"][0]["kv_from"] = 13  # beyond the session's 12 KV tokens
    with pytest.raises(ValueError, match="kv_from 13 beyond"):
        type(m).model_validate(raw)
    raw["sessions"][0]["kv_from"] = 10  # an entry starts at 8, before it
    with pytest.raises(ValueError, match="before the session's kv_from"):
        type(m).model_validate(raw)
