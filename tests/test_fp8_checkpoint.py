"""fp8_e4m3 KV checkpoints: each chunk carries the float32 scales beside the fp8 values; an fp8 session
checkpointed and restored into another fp8 replica continues token-for-token."""

import pytest
import torch
from relayout.engine.moves.placer import kv_conversion, restore
from relayout.engine.moves.snapshot import RestoreError, checkpoint
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.chunks import kv_scaled_view, pack_kv
from relayout.storage.stores import LocalStore, MemoryStore

PROMPTS = [[1, 5, 9], list(range(10, 47)), list(range(60, 75)) * 20]
PARAMS = [SamplingParams(max_tokens=12, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=12, ignore_eos=True)]


def test_scaled_chunk_round_trip_and_checks():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 3, 20, 8, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, 20, generator=g)
    for codec in ("none", "zstd-planes"):
        data, ref = pack_kv(kv, codec, scale)
        t, s = kv_scaled_view(data, ref, kv.shape, "float8_e4m3fn")
        assert torch.equal(t.view(torch.uint8), kv.view(torch.uint8)) and torch.equal(s, scale)
    with pytest.raises(CorruptCheckpoint, match="expected tensors"):  # an unscaled chunk where scales are due
        kv_scaled_view(*pack_kv(kv), kv.shape, "float8_e4m3fn")
    with pytest.raises(ValueError, match="scales must be float32"):
        pack_kv(kv, "none", scale[:, :2])


@pytest.fixture(scope="module")
def fp8():
    es = [LLMEngine("builtin:tiny", kv_dtype="fp8_e4m3", max_prefill_tokens=64) for _ in range(2)]
    yield es
    for e in es:
        e.shutdown()


def test_fp8_session_continues_token_for_token(fp8, tmp_path):
    src, dst = fp8
    undisturbed = src.generate(PROMPTS, PARAMS)
    pairs = enumerate(zip(PROMPTS, PARAMS, strict=True))
    ids = [src.add_session(p, q, session_id=f"f-{i}").session_id for i, (p, q) in pairs]
    for _ in range(8):
        src.step()
    assert any(0 < len(src.sessions[i].output_token_ids) < 12 for i in ids)
    store = LocalStore(tmp_path)
    with CheckpointWriter(store, "f8", codec="zstd") as w:
        m = checkpoint(src, w, ids)
    src.release(ids)
    assert (m.kv.dtype, m.kv.scale) == ("float8_e4m3fn", "token_head")
    reader = CheckpointReader(store, "f8")
    kv = reader.read_kv("f-2", 1, 0, m.kv.num_kv_heads)  # dequantised for a plain reader
    assert kv.dtype == torch.float32 and kv.abs().sum() > 0
    assert restore(dst, reader) == ids
    while any(not dst.sessions[i].is_finished for i in ids):
        dst.step()
    assert [dst.sessions[i].output_token_ids for i in ids] == undisturbed


def _kv_of(engine: LLMEngine, sid: str, layer: int) -> torch.Tensor:
    """The session's KV as the engine holds it, dequantised: through a checkpoint of it."""
    store = MemoryStore()
    with CheckpointWriter(store, "peek") as w:
        m = checkpoint(engine, w, [sid])
    return CheckpointReader(store, "peek").read_kv(sid, layer, 0, m.kv.num_kv_heads).float()


def test_fp8_converts_to_and_from_other_kv_dtypes_unless_exact(fp8):
    src, _ = fp8
    src.add_session(list(range(1, 40)), SamplingParams(max_tokens=6, ignore_eos=True), session_id="q")
    src.step()
    store = MemoryStore()
    with CheckpointWriter(store, "q8") as w:
        checkpoint(src, w, ["q"])
    src.release(["q"])
    plain = LLMEngine("builtin:tiny")  # float32 KV
    try:
        reader = CheckpointReader(store, "q8")
        with pytest.raises(RestoreError, match="holds float8_e4m3fn KV, this replica's KV is float32: an exact"):
            restore(plain, reader, exact=True)
        assert plain.kv_blocks_used() == 0 and not plain.sessions  # refused before anything moved
        assert kv_conversion(plain, reader.manifest) == {"from": "float8_e4m3fn", "to": "float32"}
        assert restore(plain, reader) == ["q"]  # dequantised: the very values the fp8 pool computed with
        assert torch.equal(_kv_of(plain, "q", 1), reader.read_kv("q", 1, 0, reader.manifest.kv.num_kv_heads))
        while not plain.sessions["q"].is_finished:
            plain.step()
        # and back: float32 KV quantised into the fp8 replica, within fp8's precision
        p = plain.add_session(list(range(5, 50)), SamplingParams(max_tokens=6, ignore_eos=True), session_id="p")
        plain.step()
        with CheckpointWriter(store, "p32") as w:
            checkpoint(plain, w, ["p"])
        plain.release(["p"])
        exact_kv = CheckpointReader(store, "p32").read_kv("p", 1, 0, 2)
        assert restore(src, CheckpointReader(store, "p32")) == ["p"]
        got = _kv_of(src, "p", 1)
        assert (got - exact_kv).abs().max() <= exact_kv.abs().amax(-1, keepdim=True).max() / 16
        while not src.sessions["p"].is_finished:
            src.step()
        assert p.num_computed > 0
    finally:
        plain.shutdown()
