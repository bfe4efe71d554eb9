"""Precision: chunks of every KV dtype stored exactly, the engine in bfloat16 against transformers, dtype
names refused, fp8 KV against bf16 KV. (bfloat16 checkpoints across layouts: test_bf16_layouts.py.)"""

import pytest
import torch
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.chunks import chunk_hash, kv_view, new_kv_chunk, pack_kv, unpack_kv
from relayout.storage.format.codecs import CODECS
from relayout.storage.format.manifest import KVGeometry, ModelRef
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
    # the stored payload is exactly what safetensors writes for the token-major tensor (format
    # version 2), and safetensors reads it back
    raw = bytes(data) if codec == "none" else None
    if raw is not None:
        assert raw == st_save({"kv": t.transpose(1, 2).contiguous()})
        assert same_bits(st_load(raw)["kv"].transpose(1, 2), t)
        # a version-1 chunk (heads before tokens) of the same KV reads back as the same tensor
        v1 = st_save({"kv": t.contiguous()})
        ref1 = ref.model_copy(update={"hash": chunk_hash(v1)})
        assert same_bits(unpack_kv(v1, ref1, t.shape, dtype, format_version=1), t)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_prefilled_chunk_buffer_and_dtype_checks(dtype):
    src = every_bit_pattern((2, 2, 16, 8), dtype, seed=3)
    t = new_kv_chunk(src.shape, dtype)
    t.view.copy_(src)
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


# ---- the engine in reduced precision -----------------------------------------------------------------
PROMPTS = [[1, 5, 9], [7] * 20, list(range(10, 47)), [3, 1, 4, 1, 5, 9, 2, 6], [42], list(range(100, 170)),
           [8, 8, 9, 9, 10], list(range(200, 213))]
# Parity metric: max |Δlogit| over the vocabulary divided by the reference's logit range at that step.
# bfloat16 keeps 8 significant bits (relative rounding 2^-9); the bound allows a few roundings' worth
# of drift through 2 layers. A routing choice is discontinuous: where the low-precision reference
# itself flips an expert choice that float32 makes (it then sits > BOUND from float32), ours must
# instead agree with float32.
BOUND = {torch.bfloat16: 0.02, torch.float16: 0.005}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / (ref.max() - ref.min()))


@pytest.mark.parametrize("arch,dtype", [("qwen3moe", torch.bfloat16), ("mixtral", torch.bfloat16),
                                        ("qwen3moe", torch.float16)], ids=str)
def test_reduced_precision_parity_with_transformers(hf_models, arch, dtype):
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams
    from transformers import AutoModelForCausalLM

    path = hf_models[arch]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ref32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n, bound = 8, BOUND[dtype]
    eng = LLMEngine(str(path), max_prefill_tokens=32, dtype=dtype)
    assert eng.dtype == dtype and eng.executor.runner.kv.k[0].dtype == dtype  # type: ignore[attr-defined]
    assert eng.executor.runner.model.lm_head.dtype == dtype  # type: ignore[attr-defined]
    seen: dict[str, list[torch.Tensor]] = {}
    eng.logits_hook = lambda sid, lg: seen.setdefault(sid, []).append(lg.clone())
    sessions = [eng.add_session(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in PROMPTS]
    while eng.has_work():
        eng.step()
    eng.shutdown()
    errs, flips, decisive, equal_prompts = [], 0, 0, 0
    for p, s in zip(PROMPTS, sessions, strict=True):
        ids, all_decisive = list(p), True
        for step in range(n):
            with torch.no_grad():  # the references on OUR prefix: every step is compared
                theirs = ref(torch.tensor([ids])).logits[0, -1].float()
                theirs32 = ref32(torch.tensor([ids])).logits[0, -1].float()
            ours = seen[s.session_id][step]
            assert ours.dtype == torch.float32  # sampling sees float32 logits
            err = rel_err(ours, theirs)
            errs.append(err)
            where = f"prompt len {len(p)} step {step}"
            if err > bound:  # only where the reference's own rounding flipped a routing choice
                flips += 1
                assert rel_err(theirs, theirs32) > bound, f"{where}: {err:.4f} from {dtype} transformers"
                assert rel_err(ours, theirs32) <= bound, f"{where}: {rel_err(ours, theirs32):.4f} from float32"
                all_decisive = False
            else:
                top2 = theirs.topk(2).values
                if float(top2[0] - top2[1]) / float(theirs.max() - theirs.min()) > 2 * bound:
                    decisive += 1
                    assert s.output_token_ids[step] == int(theirs.argmax()), f"{where}: greedy token differs"
                else:
                    all_decisive = False
            ids.append(s.output_token_ids[step])
        equal_prompts += all_decisive
    errs_t = torch.tensor(errs)
    print(f"\n{arch} {dtype}: max|Δlogit|/range median {errs_t.median():.4f} p90 {errs_t.quantile(0.9):.4f} "
          f"max {errs_t.max():.4f} (bound {bound}); reference routing flips {flips}/{len(errs)}; "
          f"greedy equal on {decisive} decisive steps, whole sequences on {equal_prompts}/{len(PROMPTS)} prompts")
    assert flips <= len(errs) // 10
    assert float(errs_t.median()) < bound / 2
    assert decisive >= len(errs) // 4  # the token check is not vacuous


def test_unknown_dtypes_are_refused_naming_the_allowed_values():
    from relayout.engine.model.config import check_dtype, parse_dtype, parse_kv_dtype
    from relayout.engine.runtime.engine import LLMEngine

    assert parse_dtype(None, "cpu") == torch.float32 and parse_dtype(None, "cuda") == torch.bfloat16
    assert parse_dtype("float16") == torch.float16 and check_dtype(None) is None
    with pytest.raises(ValueError, match="unknown dtype 'float64'; allowed: float32, bfloat16, float16"):
        LLMEngine("builtin:tiny", dtype="float64")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        LLMEngine("builtin:tiny", dtype=torch.int8)
    with pytest.raises(ValueError, match="unknown KV dtype 'fp4'; allowed: auto, fp8_e4m3"):
        parse_kv_dtype("fp4")


def test_fp8_kv_refused_on_a_device_that_cannot_hold_it():
    """fp8_e4m3 KV needs a CPU or CUDA device: elsewhere the engine refuses before loading anything, and
    `relayout serve` exits 2 with that reason (an agent launching such a replica answers 400 with the
    replica's output)."""
    import subprocess
    import sys

    from relayout.engine.runtime.engine import LLMEngine

    with pytest.raises(ValueError, match="kv_dtype fp8_e4m3 needs a CPU or CUDA device, not meta"):
        LLMEngine("builtin:tiny", device="meta", kv_dtype="fp8_e4m3")
    bad = subprocess.run([sys.executable, "-m", "relayout.agent.cli", "serve", "--device", "meta", "--kv-dtype",
                          "fp8_e4m3", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "kv_dtype fp8_e4m3 needs a CPU or CUDA device, not meta" in " ".join(
        bad.stderr.split()), bad.stderr


def test_cli_and_agent_refuse_bad_dtypes_and_launch_bf16(tmp_path):
    """`relayout serve --dtype float64` exits 2 naming the allowed values; the agent answers 400 for a bad
    dtype and launches a bfloat16 replica whose /v1/replica says so."""
    import subprocess
    import sys

    import httpx
    from relayout.migrate.procs import launch, stop_process

    bad = subprocess.run([sys.executable, "-m", "relayout.agent.cli", "serve", "--dtype", "float64"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dtype: unknown dtype 'float64'; allowed: float32, bfloat16, float16" in " ".join(
        bad.stderr.split()), bad.stderr
    bad = subprocess.run([sys.executable, "-m", "relayout.agent.cli", "serve", "--kv-dtype", "int4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--kv-dtype: unknown KV dtype 'int4'; allowed: auto, fp8_e4m3" in " ".join(
        bad.stderr.split()), bad.stderr
    token = "dtype-test-token"
    hdr = {"Authorization": f"Bearer {token}"}
    agent = launch("agent", "--port", "0", "--data-dir", str(tmp_path), env={"RELAYOUT_TOKEN": token})
    try:
        for body, said in (({"dtype": "float64"}, "unknown dtype 'float64'"), ({"kv_dtype": "fp4"}, "unknown KV dtype")):
            r = httpx.post(f"{agent.url}/v1/replicas", json={"model": "builtin:tiny", **body}, headers=hdr, timeout=60)
            assert r.status_code == 400 and said in r.text, r.text
        r = httpx.post(f"{agent.url}/v1/replicas", json={"model": "builtin:tiny", "dtype": "bfloat16"}, headers=hdr,
                       timeout=200)
        assert r.status_code == 201, r.text
        url = r.json()["url"]
        info = httpx.get(f"{url}/v1/replica", headers=hdr, timeout=30).json()
        assert (info["dtype"], info["kv_dtype"]) == ("bfloat16", "auto")
        # builtin:tiny: 2 layers x 2 KV heads x 16 dims x K and V, 2 bytes each
        assert info["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 2
        out = httpx.post(f"{url}/v1/completions", headers=hdr, timeout=60, json={
            "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}).json()
        assert len(out["choices"][0]["token_ids"]) == 4, out
        assert httpx.delete(f"{agent.url}/v1/replicas/{r.json()['id']}", headers=hdr, timeout=60).status_code < 300
    finally:
        stop_process(agent.p, 30)


def test_fp8_kv_greedy_agreement_with_bf16_kv():
    """fp8_e4m3 KV (a float32 scale per token and KV head) against bfloat16 KV, the model in bfloat16:
    32 prompts x 64 greedy tokens. Prints the agreement; asserts only a loose floor (the tiny random
    model's top-2 margins are small, so one flipped token sends a sequence elsewhere)."""
    import random

    from relayout.engine.kv_cache import FP8_KV
    from relayout.engine.moves.snapshot import checkpoint
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams

    rnd = random.Random(0)
    prompts = [[rnd.randrange(1, 250) for _ in range(rnd.randrange(4, 60))] for _ in range(32)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    out, num_blocks = {}, {}
    for kv in ("auto", "fp8_e4m3"):
        eng = LLMEngine("builtin:tiny", dtype="bfloat16", kv_dtype=kv, kv_cache_bytes=8 << 20)
        pool = eng.executor.runner.kv  # type: ignore[attr-defined]
        assert pool.k[0].dtype == (FP8_KV if kv != "auto" else torch.bfloat16)
        out[kv] = eng.generate(prompts, params)
        if kv != "auto":
            assert eng.num_blocks > 1.5 * num_blocks["auto"]  # fp8 + scales: about half the bytes per block
            eng.add_session([1, 2, 3], params, session_id="held")
            eng.step()
            # checkpoints carry the scales now (tests/test_fp8_checkpoint.py restores them token for token)
            m = checkpoint(eng, CheckpointWriter(MemoryStore(), "fp8"), ["held"])
            assert (m.kv.dtype, m.kv.scale) == ("float8_e4m3fn", "token_head")
        num_blocks[kv] = eng.num_blocks
        eng.shutdown()
    # the yardstick: how far the same prompts drift between the model in float32 and in bfloat16
    eng = LLMEngine("builtin:tiny", dtype="float32", kv_cache_bytes=8 << 20)
    out["float32"] = eng.generate(prompts, params)
    eng.shutdown()

    def agreement(a_out: list[list[int]], b_out: list[list[int]]) -> tuple[str, float]:
        same = sum(x == y for a, b in zip(a_out, b_out, strict=True) for x, y in zip(a, b, strict=True))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 64)
                  for a, b in zip(a_out, b_out, strict=True)]
        return (f"tokens equal at {same / (32 * 64):.1%} of positions, mean common prefix {sum(prefix) / 32:.1f} "
                f"tokens, {prefix.count(64)}/32 sequences identical"), sum(prefix) / 32

    fp8_said, fp8_prefix = agreement(out["auto"], out["fp8_e4m3"])
    print(f"\nfp8_e4m3 vs bfloat16 KV (model in bfloat16), 32 prompts x 64 greedy tokens: {fp8_said}"
          f"\nyardstick, bfloat16 vs float32 model: {agreement(out['float32'], out['auto'])[0]}")
    assert fp8_prefix >= 8
