"""Old checkpoints still restore: format-version-1 checkpoints (chunks stored [2, heads, tokens, head_dim]),
written by the version-1 code and kept under tests/fixtures/, read and restore under the version-2 code
(chunks stored token-major)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from relayout.engine.moves.placer import restore
from relayout.engine.moves.snapshot import checkpoint
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.format.manifest import FORMAT_VERSION
from relayout.storage.stores import LocalStore
from safetensors.torch import load as st_load

from tests.helpers.checkpoints import H, L, kv_tensor

FIXTURES = Path(__file__).parent / "fixtures"


def _store(tmp_path: Path, name: str) -> LocalStore:
    shutil.copytree(FIXTURES / name, tmp_path / name)  # a store may write beside what it reads
    return LocalStore(tmp_path / name)


@pytest.mark.parametrize("cid,sessions", [("fmt-v1-none", {"a": (1, 7), "b": (2, 12)}),
                                          ("fmt-v1-zstd", {"a": (3, 9)})])
def test_version_1_chunks_read_under_any_head_range(tmp_path, cid, sessions):
    r = CheckpointReader(_store(tmp_path, "format-v1"), cid)
    assert r.manifest.format_version == 1 and FORMAT_VERSION == 2
    r.verify()
    for sid, (seed, tokens) in sessions.items():
        kv = kv_tensor(seed, tokens)
        for layer in range(L):
            assert torch.equal(r.read_kv(sid, layer, 0, H), kv[layer])
            assert torch.equal(r.read_kv(sid, layer, 1, 3), kv[layer, :, 1:3])  # spans both stored ranges
            for h in range(H):
                assert torch.equal(r.read_kv(sid, layer, h, h + 1), kv[layer, :, h : h + 1])


@pytest.fixture(scope="module")
def engines():
    # the fixture was written by builtin:tiny before its weights were trained: builtin:tiny-random is that model
    es = {lay: LLMEngine("builtin:tiny-random", lay, max_prefill_tokens=16) for lay in ("attn_dp=1", "attn_tp=2")}
    yield es
    for e in es.values():
        e.shutdown()


@pytest.mark.parametrize("layout", ["attn_dp=1", "attn_tp=2"])
def test_version_1_checkpoint_restores_and_continues(engines, tmp_path, layout):
    expected = json.loads((FIXTURES / "checkpoint-v1" / "expected.json").read_text())
    eng = engines[layout]
    shutil.copytree(FIXTURES / "checkpoint-v1" / "store", tmp_path / "store")
    reader = CheckpointReader(LocalStore(tmp_path / "store"), "ckpt-v1")
    assert reader.manifest.format_version == 1
    ids = restore(eng, reader)
    assert ids == expected["sessions"]
    while any(not eng.sessions[i].is_finished for i in ids):
        eng.step()
    assert [eng.sessions[i].output_token_ids for i in ids] == expected["outputs"]
    for i in ids:  # finished: nothing left to free, only the names to reuse under the next layout
        del eng.sessions[i]


def test_new_checkpoints_are_version_2_token_major(engines, tmp_path):
    eng = engines["attn_dp=1"]
    s = eng.add_session(list(range(1, 40)), SamplingParams(max_tokens=4), session_id="v2")
    eng.step()
    store = LocalStore(tmp_path)
    with CheckpointWriter(store, "c") as w:
        m = checkpoint(eng, w, ["v2"])
    eng.release(["v2"])
    assert m.format_version == 2
    e = m.kv_entries[0]
    stored = st_load(bytes(store.get_chunk(e.chunk.hash)))["kv"]
    assert stored.shape == (2, e.tok_hi - e.tok_lo, e.head_hi - e.head_lo, m.kv.head_dim)
    assert s.num_computed > 0
    read = CheckpointReader(store, "c").read_kv("v2", e.layer, 0, m.kv.num_kv_heads)
    assert torch.equal(stored.transpose(1, 2), read[:, :, e.tok_lo : e.tok_hi])
