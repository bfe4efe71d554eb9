"""A target's staging of incoming rounds (migrate/protocol/received.py): bytes go once imported, hashes stay,
and the same bytes arriving again (another session's identical chunk) are held anew."""

from __future__ import annotations

import pytest
import torch
from relayout.migrate.protocol.received import ReceivedChunks
from relayout.storage.checkpoint import CheckpointWriter
from relayout.storage.errors import ChunkMissing
from relayout.storage.format.manifest import KVGeometry, ModelRef


def _round(store: ReceivedChunks, kv: torch.Tensor, sessions: list[str]):
    w = CheckpointWriter(store, "round-1")
    for sid in sessions:
        w.put_kv(sid, 0, 0, 2, 0, 16, kv)
        w.add_session(sid, {}, 16)
    return w.commit(ModelRef(name="m", fingerprint="f" * 16, config={}), {},
                    KVGeometry(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float32"), {})


def test_imported_bytes_go_and_come_back_when_needed_again():
    store = ReceivedChunks()
    kv = torch.arange(2 * 2 * 16 * 8, dtype=torch.float32).reshape(2, 2, 16, 8)
    m = _round(store, kv, ["a"])
    [h] = {e.chunk.hash for e in m.kv_entries}
    store.forget_imported(m, {"a": 8}, 0)  # half imported: the bytes are still needed
    assert store.get_chunk(h) and store.chunk_hashes() == [h]
    store.forget_imported(m, {"a": 16}, 0)
    assert store.has_chunk(h) and store.chunk_hashes() == []  # the manifest may list it; a resume resends it
    with pytest.raises(ChunkMissing):
        store.get_chunk(h)
    # a later round: session b's chunk has the same bytes (e.g. the same prompt); its frame brings them again
    m2 = _round(store, kv, ["b"])
    assert {e.chunk.hash for e in m2.kv_entries} == {h}
    assert store.get_chunk(h) and store.chunk_hashes() == [h]
