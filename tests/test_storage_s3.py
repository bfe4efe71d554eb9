"""S3Store against moto's S3 server over real HTTP (configured only through the environment)."""

from __future__ import annotations

import pytest
import torch
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.errors import CheckpointNotFound, ChunkMissing, CorruptCheckpoint
from relayout.storage.format.manifest import KVGeometry, ModelRef
from relayout.storage.stores import S3Store, open_store

from tests.conftest import S3_BUCKET

pytest.importorskip("moto.server")

BUCKET = S3_BUCKET  # the conftest's moto server and s3_env fixture serve every S3 test


def _write(store: S3Store, cid: str, kv: torch.Tensor, codec: str = "none") -> None:
    layers, _, heads, tokens, head_dim = kv.shape
    w = CheckpointWriter(store, cid, codec=codec)
    for layer in range(layers):
        w.put_kv("sess-1", layer, 0, heads // 2, 0, tokens, kv[layer, :, : heads // 2])
        w.put_kv("sess-1", layer, heads // 2, heads, 0, tokens, kv[layer, :, heads // 2 :])
    w.add_session("sess-1", {"generated": [1, 2]}, tokens)
    w.commit(
        ModelRef(name="m", fingerprint="fp", config={}),
        {"attn_tp": 2},
        KVGeometry(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype="float32"),
    )


def test_s3_round_trip_multipart_list_delete(s3_env: str) -> None:
    store = open_store(f"s3://{BUCKET}/ckpts/a")
    assert isinstance(store, S3Store)
    store = S3Store(BUCKET, "ckpts/a", multipart_threshold=5 * 1024 * 1024)
    # 2 layers × [2, 2, 1024, 1024] float32 = 16 MiB per chunk → 4 multipart uploads.
    kv = torch.randn(2, 2, 4, 1024, 1024, generator=torch.Generator().manual_seed(0))
    uploads: list[str] = []
    parts: list[str] = []
    events = store.client.meta.events
    events.register("before-call.s3.CreateMultipartUpload", lambda **kw: uploads.append(kw["params"]["url_path"]))
    events.register("before-call.s3.UploadPart", lambda **kw: parts.append(kw["params"]["url_path"]))
    _write(store, "ck-1", kv)
    assert len(uploads) == 4 and len(parts) == 4 * 4  # 16 MiB in 5 MiB parts

    assert store.list_checkpoints() == ["ck-1"]
    r = CheckpointReader(store, "ck-1")
    r.verify()
    assert torch.equal(r.read_kv("sess-1", 1, 1, 3), kv[1, :, 1:3])

    # Incremental: a second checkpoint of the same KV uploads nothing new.
    uploads.clear()
    _write(store, "ck-2", kv)
    assert uploads == []
    store.delete_checkpoint("ck-1")
    assert store.list_checkpoints() == ["ck-2"]
    CheckpointReader(store, "ck-2").verify()
    store.delete_checkpoint("ck-2")
    assert store.list_checkpoints() == [] and list(store._iter_chunks()) == []
    with pytest.raises(CheckpointNotFound):
        store.get_manifest("ck-2")


def test_s3_corruption_missing_and_incomplete(s3_env: str) -> None:
    store = S3Store(BUCKET, "ckpts/b")
    kv = torch.randn(1, 2, 2, 8, 4)
    _write(store, "ck", kv, codec="zstd")
    r = CheckpointReader(store, "ck")
    h = r.manifest.kv_entries[0].chunk.hash
    key = f"ckpts/b/chunks/{h[:2]}/{h}"
    good = store.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    store.client.put_object(Bucket=BUCKET, Key=key, Body=bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(CorruptCheckpoint, match=h):
        r.verify()
    store.client.delete_object(Bucket=BUCKET, Key=key)
    with pytest.raises(ChunkMissing, match=h):
        r.read_kv("sess-1", 0, 0, 2)

    # Chunks without a manifest are invisible, and collected once old enough.
    w = CheckpointWriter(store, "half")
    w.put_kv("sess-1", 0, 0, 2, 0, 8, kv[0])
    assert store.list_checkpoints() == ["ck"]
    w.abort()
    store.delete_checkpoint("ck")
    assert store.cleanup_incomplete(max_age_s=-60) >= 1
    assert list(store._iter_chunks()) == []
