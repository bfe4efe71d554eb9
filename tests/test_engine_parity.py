"""The engine against Hugging Face transformers on the same weights."""

import pytest
import torch
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams

PROMPTS = [[1, 5, 9], [7] * 20, list(range(10, 47)), [3, 1, 4, 1, 5, 9, 2, 6], [42], list(range(100, 170)),
           [8, 8, 9, 9, 10], list(range(200, 213))]


def hf_greedy(model, prompt, n):
    """Reference: full forward without cache at every step, last-position logits and greedy tokens."""
    ids, logits, toks = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            out = model(torch.tensor([ids])).logits[0, -1].float()
            logits.append(out)
            t = int(out.argmax())
            toks.append(t)
            ids.append(t)
    return toks, logits


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_logits_and_greedy_match_transformers(hf_models, arch):
    from transformers import AutoModelForCausalLM

    path = hf_models[arch]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = 8
    eng = LLMEngine(str(path), max_prefill_tokens=32)  # chunked prefill for the longer prompts
    seen: dict[str, list[torch.Tensor]] = {}
    eng.logits_hook = lambda sid, lg: seen.setdefault(sid, []).append(lg.clone())
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    sessions = [eng.add_session(p, params) for p in PROMPTS]  # all served concurrently
    while eng.has_work():
        eng.step()
    distinct = set()
    for p, s in zip(PROMPTS, sessions, strict=True):
        toks, logits = hf_greedy(ref, p, n)
        assert s.output_token_ids == toks, f"prompt len {len(p)}"
        for step, (ours, theirs) in enumerate(zip(seen[s.session_id], logits, strict=True)):
            rel = (ours - theirs).abs().max() / theirs.abs().max()
            assert rel < 1e-4, f"prompt len {len(p)} step {step}: relative error {rel:.2e}"
        distinct.add(tuple(toks))
    assert len(distinct) > 1  # the models are not degenerate
    eng.shutdown()


def test_seeded_sampling_independent_of_batch(hf_models):
    eng = LLMEngine(str(hf_models["qwen3moe"]))
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    alone = eng.generate([[5, 6, 7, 8]], p)[0]
    others = [SamplingParams(max_tokens=10 + i, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(15)]
    batched = eng.generate([[5, 6, 7, 8]] + [[i + 1] * (i + 2) for i in range(15)], [p] + others)
    assert batched[0] == alone
    again = eng.generate([[5, 6, 7, 8]], SamplingParams(**{**p.__dict__, "seed": 8}))[0]
    assert again != alone  # the seed matters
