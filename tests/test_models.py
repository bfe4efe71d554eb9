"""Builtin models, weight loading, fingerprints and tokenizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from relayout.engine.model.builtin import BUILTIN_NAMES, builtin_tensors, create_builtin
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, load_tokenizer
from relayout.engine.model.weights import (
    ModelNotFoundError,
    load_weight_slice,
    load_weights,
    model_fingerprint,
    resolve_model,
    weight_files,
)
from safetensors import safe_open

SMALL = ("tiny", "tiny-mixtral")
PROMPTS = [b"Hello, world", b"The quick brown fox", b"abc", b"\x00\x01\x02"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("builtin")
    return {n: create_builtin(n, root / n) for n in (*SMALL, "bench")}


def _file_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("name", SMALL)
def test_builtin_deterministic(made, tmp_path, name):
    rng_before = torch.get_rng_state()
    again = create_builtin(name, tmp_path / name)
    assert torch.equal(torch.get_rng_state(), rng_before), "creation must not touch the global RNG"
    assert _file_bytes(again) == _file_bytes(made[name])
    assert model_fingerprint(again) == model_fingerprint(made[name])


def test_builtin_configs(made):
    assert BUILTIN_NAMES == ("tiny", "bench", "tiny-mixtral", "tiny-random")
    tiny = ModelConfig.from_dir(made["tiny"])
    assert (tiny.architecture, tiny.vocab_size, tiny.hidden_size, tiny.num_layers) == (
        "Qwen3MoeForCausalLM",
        260,
        64,
        2,
    )
    assert (tiny.num_heads, tiny.num_kv_heads, tiny.head_dim, tiny.num_experts, tiny.top_k) == (
        4,
        2,
        16,
        8,
        2,
    )
    assert tiny.norm_topk_prob and tiny.qk_norm and tiny.dense_layers == ()
    assert (tiny.bos_token_id, tiny.eos_token_id, tiny.rope_theta) == (256, (257,), 10000.0)
    mix = ModelConfig.from_dir(made["tiny-mixtral"])
    assert mix.architecture == "MixtralForCausalLM" and mix.num_experts == 8 and not mix.qk_norm
    bench = ModelConfig.from_dir(made["bench"])
    assert bench.kv_bytes_per_token == 2 * 8 * 8 * 128 * 4
    assert bench.max_position_embeddings == 32768 and bench.num_experts == 16
    # Bench is created once (size); spot-check its determinism against a fresh generation.
    fresh = builtin_tensors("bench")
    got = load_weights(made["bench"], lambda n: n.endswith("layers.3.mlp.experts.7.down_proj.weight"))
    assert torch.equal(
        got["model.layers.3.mlp.experts.7.down_proj.weight"],
        fresh["model.layers.3.mlp.experts.7.down_proj.weight"],
    )


@pytest.mark.parametrize("name", SMALL)
def test_transformers_loads_and_generates(made, tmp_path, name):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(made[name], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # What save_pretrained writes back is what we wrote (config, generation config, names).
    model.save_pretrained(tmp_path / "re")
    # (but for transformers_version: who wrote the file, e.g. the older transformers vLLM pins)
    for f in ("config.json", "generation_config.json"):
        back, ours = (json.loads(p.read_text()) for p in (tmp_path / "re" / f, made[name] / f))
        assert back.pop("transformers_version") == transformers.__version__
        ours.pop("transformers_version")
        assert back == ours
    assert set(weight_files(tmp_path / "re")) == set(weight_files(made[name]))
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([list(p)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        outs.append(tuple(out[0, ids.shape[1] :].tolist()))
    assert all(len(set(o)) > 1 for o in outs), outs
    assert len(set(outs)) == len(outs), outs


def test_sharded_roundtrip_and_filters(made, tmp_path):
    sharded = create_builtin("tiny", tmp_path / "sharded", shards=3)
    names = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    full = load_weights(made["tiny"])
    assert set(index["weight_map"]) == set(full)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in full.values())
    got = load_weights(sharded)
    assert set(got) == set(full) and all(torch.equal(got[k], full[k]) for k in full)
    for f in names:
        with safe_open(sharded / f, "pt") as h:
            assert h.metadata() == {"format": "pt"}

    want = {"model.layers.1.mlp.experts.5.up_proj.weight", "lm_head.weight"}
    for d in (made["tiny"], sharded):
        part = load_weights(d, want.__contains__)
        assert set(part) == want and all(torch.equal(part[k], full[k]) for k in want)
    # A rank's expert filter: only experts 4..7 of every layer.
    mine = load_weights(
        sharded, lambda n: ".experts." in n and int(n.split(".experts.")[1].split(".")[0]) >= 4
    )
    assert len(mine) == 2 * 4 * 3


@pytest.mark.parametrize("dim,start,stop", [(0, 8, 24), (1, 16, 48), (-1, 0, 5)])
def test_load_weight_slice(made, tmp_path, dim, start, stop):
    sharded = create_builtin("tiny", tmp_path / "s", shards=2)
    name = "model.layers.0.self_attn.q_proj.weight"
    full = load_weights(made["tiny"], {name}.__contains__)[name]
    want = full.narrow(dim, start, stop - start)
    for d in (made["tiny"], sharded):
        assert torch.equal(load_weight_slice(d, name, dim, start, stop), want)
    with pytest.raises(KeyError):
        load_weight_slice(made["tiny"], "nope", 0, 0, 1)


def test_resolve_model(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYOUT_CACHE", str(tmp_path / "cache"))
    d = resolve_model("builtin:tiny")
    assert d.parent == tmp_path / "cache" / "models" and (d / "config.json").is_file()
    assert resolve_model("builtin:tiny") == d  # cached: the same directory
    assert [p.name for p in d.parent.iterdir()] == [d.name]  # no leftover temp dirs
    assert resolve_model(str(d)) == d.resolve()
    with pytest.raises(ModelNotFoundError, match="builtin:tiny"):
        resolve_model("builtin:nope")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(tmp_path / "missing"))


def test_fingerprint_tracks_content(made, tmp_path):
    a, b = made["tiny"], made["tiny-mixtral"]
    assert model_fingerprint(a) != model_fingerprint(b)
    c = shutil.copytree(a, tmp_path / "copy")
    assert model_fingerprint(c) == model_fingerprint(a)
    cfg = json.loads((c / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (c / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(c) != model_fingerprint(a)  # cache keyed on mtime/size, not path alone


def test_byte_tokenizer_and_streaming(made):
    tok = load_tokenizer(made["tiny"], ModelConfig.from_dir(made["tiny"]))
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_token_ids) == (260, (257,))
    text = "héllo wörld — €100 🙂 漢字"
    ids = tok.encode(text)
    assert ids == list(text.encode()) and tok.decode(ids) == text
    assert tok.decode([256, *ids, 257, 259]) == text  # specials decode to ""

    det = IncrementalDetokenizer(tok)
    pieces = [det.add(i) for i in [256, *ids, 257]]
    assert "".join(pieces) == text == det.text
    assert all("\ufffd" not in p for p in pieces)
    # multi-byte characters were held back (empty pieces), then emitted whole
    assert pieces[1:-1].count("") == len(ids) - len(text)
    assert "🙂" in pieces and "€" in pieces
    assert det.flush() == ""

    # An incomplete tail is only emitted (as U+FFFD) at the end of the stream.
    det = IncrementalDetokenizer(tok)
    assert det.add_many([ord("a"), 0xE2, 0x82]) == "a"
    assert det.flush() == "\ufffd"


def _bpe_tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(["hello world", "hello there", "the world is wide"] * 20, trainer=trainer)
    tk.save(str(path))


def test_tokenizer_json_is_used(made, tmp_path):
    d = shutil.copytree(made["tiny"], tmp_path / "withtok")
    _bpe_tokenizer_json(d / "tokenizer.json")
    tok = load_tokenizer(d, ModelConfig.from_dir(d))
    assert isinstance(tok, HFTokenizer)
    text = "hello world, héllo wörld 🙂"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges were learned and applied
    assert tok.decode(ids) == text
    eos = tok.encode("</s>")
    assert tok.decode([*ids, *eos]) == text  # special tokens skipped

    det = IncrementalDetokenizer(tok)
    pieces = [det.add(i) for i in ids]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert "🙂" in pieces  # 4 byte-tokens, emitted as one character


def test_config_defaults_and_refusals(made):
    from relayout.engine.model.config import ModelConfigError

    hf = json.loads((made["tiny-mixtral"] / "config.json").read_text())
    for k in ("rope_parameters", "rms_norm_eps", "max_position_embeddings"):
        hf.pop(k)
    cfg = ModelConfig.from_hf(hf)  # Mixtral's own defaults, not Qwen3's
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e6, 1e-5, 131072)
    with pytest.raises(ModelConfigError, match="sliding_window"):
        ModelConfig.from_hf({**hf, "sliding_window": 4096})
    q = json.loads((made["tiny"] / "config.json").read_text())
    # ignored while use_sliding_window is false
    assert ModelConfig.from_hf({**q, "sliding_window": 16}).num_layers == 2
    with pytest.raises(ModelConfigError, match="sliding_window"):
        ModelConfig.from_hf({**q, "sliding_window": 16, "use_sliding_window": True})
    with pytest.raises(ModelConfigError, match="attention_bias"):
        ModelConfig.from_hf({**q, "attention_bias": True})


def test_resolve_model_concurrent(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("RELAYOUT_CACHE", str(tmp_path))
    with ThreadPoolExecutor(4) as pool:
        dirs = set(pool.map(lambda _: resolve_model("builtin:tiny-mixtral"), range(4)))
    assert len(dirs) == 1
    d = dirs.pop()
    assert [p.name for p in d.parent.iterdir()] == [d.name]
    assert ModelConfig.from_dir(d).architecture == "MixtralForCausalLM"


@pytest.mark.parametrize("name", SMALL)
def test_trained_builtins_write_words_of_their_training_text(name):
    """builtin:tiny and builtin:tiny-mixtral ship trained weights (bench/train_builtin.py): a greedy
    completion of an English prompt is letters, spaces and punctuation, and its words are the training
    stories' words. (Their parity with transformers is tests/test_engine_parity.py's, on these weights.)"""
    import re

    from relayout.bench.train_builtin import corpus
    from relayout.engine.model.builtin import TRAINED_DIR
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams

    assert (TRAINED_DIR / f"{name}.safetensors").exists()
    e = LLMEngine(f"builtin:{name}")
    try:
        s = e.add_session(list(b"Once upon a time, there was a"), SamplingParams(max_tokens=160, ignore_eos=True))
        while not s.is_finished:
            e.step()
    finally:
        e.shutdown()
    text = bytes(t for t in s.output_token_ids if t < 256).decode(errors="replace")
    readable = sum(c.isalpha() or c in " .,!?\"\n" for c in text) / len(text)
    assert readable > 0.97, text
    vocab = set(re.findall(r"[A-Za-z]+", corpus(4000).decode()))
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) > 20 and sum(w in vocab for w in words) / len(words) > 0.9, text
