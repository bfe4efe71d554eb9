"""Sessions checkpointed mid-generation under one layout continue token-for-token under another."""

import itertools
import json

import pytest
from relayout.engine.model.layout import Layout
from relayout.engine.moves.placer import restore
from relayout.engine.moves.snapshot import RestoreError, checkpoint
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.errors import ChunkMissing, CorruptCheckpoint, ModelMismatch
from relayout.storage.stores import LocalStore, S3Store

LAYOUTS = ["attn_dp=1", "attn_tp=2", "attn_dp=2,moe_ep=2", "attn_dp=2,attn_tp=2,moe_ep=4"]
PROMPTS = [[1, 5, 9], [7] * 20, list(range(10, 47)), [42, 43], list(range(60, 75))]
PARAMS = [SamplingParams(max_tokens=10, ignore_eos=True)] * 3 + [
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.2, top_k=20, seed=77, ignore_eos=True),
]


@pytest.fixture(scope="module")
def engines():
    es = {lay: LLMEngine("builtin:tiny", lay, max_prefill_tokens=16) for lay in LAYOUTS}
    yield es
    for e in es.values():
        e.shutdown()


@pytest.fixture(scope="module")
def undisturbed(engines):
    return engines["attn_dp=1"].generate(PROMPTS, PARAMS)


def start(engine: LLMEngine, steps: int, tag: str) -> list[str]:
    ids = [engine.add_session(p, q, session_id=f"{tag}-{i}").session_id for i, (p, q) in enumerate(zip(PROMPTS, PARAMS, strict=True))]
    for _ in range(steps):
        engine.step()
    return ids


def finish(engine: LLMEngine, ids: list[str]) -> list[list[int]]:
    while any(not engine.sessions[i].is_finished for i in ids):
        engine.step()
    return [engine.sessions[i].output_token_ids for i in ids]


@pytest.mark.parametrize("src", LAYOUTS)
def test_every_layout_pair(engines, undisturbed, src, tmp_path):
    store = LocalStore(tmp_path)
    source = engines[src]
    ids = start(source, 4, f"s{LAYOUTS.index(src)}")  # mid-prefill for the long prompt, mid-decode for others
    assert any(0 < len(source.sessions[i].output_token_ids) < 10 for i in ids)
    with CheckpointWriter(store, "c1") as w:
        checkpoint(source, w, ids)
    source.release(ids)
    assert source.kv_blocks_used() == 0
    for dst in LAYOUTS:
        if dst == src:
            continue
        target = engines[dst]
        restore(target, CheckpointReader(store, "c1"))
        assert finish(target, ids) == undisturbed, f"{src} -> {dst}"
    m = json.loads(store.get_manifest("c1"))
    assert m["source_layout"]["attn_tp"] == Layout.parse(src).attn_tp


_n = itertools.count()


@pytest.fixture()
def ckpt(engines, tmp_path):
    """A committed checkpoint of running sessions, and its store."""
    source = engines["attn_dp=1"]
    ids = start(source, 3, f"bad{next(_n)}")
    store = LocalStore(tmp_path)
    with CheckpointWriter(store, "c2") as w:
        checkpoint(source, w, ids)
    source.release(ids)
    return store


def _target_untouched(target: LLMEngine):
    """Runs a session on the target; returns a check that it continues correctly after a refused restore."""
    s = target.add_session([3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True), session_id="bystander")
    target.step()
    target.step()
    used = target.kv_blocks_used()
    sessions = set(target.sessions)

    def check():
        assert target.kv_blocks_used() == used and set(target.sessions) == sessions
        while not s.is_finished:
            target.step()
        ref = target.generate([[3, 4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        assert s.output_token_ids == ref
        del target.sessions["bystander"]
    return check


def _corrupt_one_chunk(store: LocalStore, which: int):
    chunks = sorted((store.root / "chunks").rglob("*"))
    f = [c for c in chunks if c.is_file()][which]
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))
    return f.name


@pytest.mark.parametrize("which,dst", [(0, "attn_tp=2"), (-1, "attn_tp=2"), (0, "attn_dp=1"), (-1, "attn_dp=1")])
def test_flipped_byte_refused(engines, ckpt, which, dst, monkeypatch):
    # attn_dp=1: a host pool, whose restore hashes each chunk as it copies it (in pieces of a few rows here)
    monkeypatch.setattr("relayout.engine.kv_cache.HASH_PIECE", 100)
    target = engines[dst]
    check = _target_untouched(target)
    name = _corrupt_one_chunk(ckpt, which)
    with pytest.raises(CorruptCheckpoint, match=name[:12]):
        restore(target, CheckpointReader(ckpt, "c2"))
    check()


def test_truncated_manifest_missing_chunk_other_model(engines, ckpt, tmp_path):
    target = engines["attn_dp=2,moe_ep=2"]
    check = _target_untouched(target)
    raw = ckpt.get_manifest("c2")
    (ckpt.root / "manifests" / "c2.json").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CorruptCheckpoint):
        CheckpointReader(ckpt, "c2")
    (ckpt.root / "manifests" / "c2.json").write_bytes(raw)
    victim = next(c for c in (ckpt.root / "chunks").rglob("*") if c.is_file())
    victim.unlink()
    with pytest.raises(ChunkMissing):
        restore(target, CheckpointReader(ckpt, "c2"))
    other = LLMEngine("builtin:tiny-mixtral")
    with pytest.raises(ModelMismatch, match="tiny"):
        restore(other, CheckpointReader(ckpt, "c2"))
    other.shutdown()
    check()


def test_not_enough_blocks_refused(ckpt):
    small = LLMEngine("builtin:tiny", num_blocks=6)
    small.add_session([1] * 40, SamplingParams(max_tokens=20, ignore_eos=True), session_id="hog")
    small.step()
    used = small.kv_blocks_used()
    with pytest.raises(RestoreError, match="free KV blocks"):
        restore(small, CheckpointReader(ckpt, "c2"))
    assert small.kv_blocks_used() == used and set(small.sessions) == {"hog"}


def test_incremental_checkpoints_share_chunks(engines, tmp_path):
    eng = engines["attn_dp=1"]
    s = eng.add_session(list(range(1, 250)) * 2, SamplingParams(max_tokens=40, ignore_eos=True), session_id="inc")
    while s.num_computed < 498:
        eng.step()
    store = LocalStore(tmp_path)
    with CheckpointWriter(store, "a") as w:
        checkpoint(eng, w, ["inc"])
    n1 = sum(1 for c in (tmp_path / "chunks").rglob("*") if c.is_file())
    for _ in range(5):
        eng.step()
    with CheckpointWriter(store, "b") as w:
        checkpoint(eng, w, ["inc"])
    n2 = sum(1 for c in (tmp_path / "chunks").rglob("*") if c.is_file())
    layers = eng.cfg.num_layers
    # tokens [0, 256) are one full chunk per layer, shared; only the tail chunk is new
    assert n2 - n1 == layers
    eng.release(["inc"])


def test_s3_round_trip(engines, undisturbed, s3_env):
    source, target = engines["attn_tp=2"], engines["attn_dp=2,moe_ep=2"]
    ids = start(source, 5, "viaS3")
    store = S3Store("relayout-test", "ckpts")
    with CheckpointWriter(store, "s3ck", codec="zstd") as w:
        checkpoint(source, w, ids)
    source.release(ids)
    assert "s3ck" in S3Store("relayout-test", "ckpts").list_checkpoints()
    restore(target, CheckpointReader(S3Store("relayout-test", "ckpts"), "s3ck"))
    assert finish(target, ids) == undisturbed


def test_ordered_pairs_cover_all_fields():
    pairs = list(itertools.permutations(LAYOUTS, 2))
    assert len(pairs) == 12
    lays = [Layout.parse(x) for x in LAYOUTS]
    assert len({x.attn_tp for x in lays}) > 1 and len({x.attn_dp for x in lays}) > 1 and len({x.moe_ep for x in lays}) > 1


@pytest.mark.parametrize("piece", [1, 100, 1 << 20])
def test_hashed_in_pieces(engines, undisturbed, piece, monkeypatch, tmp_path):
    """A host pool's snapshot and restore hash each chunk piece by piece as they copy it: whatever
    the piece size, the chunks hash as stored (a reader of another layout verifies them whole) and
    the sessions continue token for token."""
    monkeypatch.setattr("relayout.engine.kv_cache.HASH_PIECE", piece)
    store = LocalStore(tmp_path)
    source = engines["attn_dp=1"]
    ids = start(source, 4, f"piece{piece}")
    with CheckpointWriter(store, "c3") as w:
        checkpoint(source, w, ids)
    source.release(ids)
    assert CheckpointReader(store, "c3").verify() > 0
    restore(source, CheckpointReader(store, "c3"))
    assert finish(source, ids) == undisturbed
    source.release(ids)
    restore(engines["attn_tp=2"], CheckpointReader(store, "c3"))
    assert finish(engines["attn_tp=2"], ids) == undisturbed
