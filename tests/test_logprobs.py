"""Logprobs: transformers' log_softmax on the same weights, kept in the session's state, and the
completions API's legacy shape (streamed, not streamed, through the gateway)."""

import httpx
import pytest
import torch
from openai import OpenAI
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams, SessionState
from relayout.migrate import procs

PROMPTS = [[1, 5, 9], list(range(10, 47)), [42]]


def hf_logprobs(model, prompt: list[int], out: list[int]) -> list[torch.Tensor]:
    """log_softmax of transformers' last-position logits before each of `out`'s tokens."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return [torch.log_softmax(logits[len(prompt) - 1 + i], dim=-1) for i in range(len(out))]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_transformers(hf_models, temperature):
    """Raw logprobs (before temperature / top-p), chosen and top 5, greedy and sampled."""
    from transformers import AutoModelForCausalLM

    path = hf_models["qwen3moe"]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = LLMEngine(str(path), max_prefill_tokens=16)  # chunked prefill for the longer prompt
    params = [SamplingParams(max_tokens=6, temperature=temperature, top_p=0.9, seed=3, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=6, temperature=temperature, seed=4, ignore_eos=True)]  # did not ask
    sessions = [eng.add_session(p, params[1 if i == 1 else 0]) for i, p in enumerate(PROMPTS)]
    while eng.has_work():
        eng.step()
    for i, s in enumerate(sessions):
        if s.sampling.logprobs is None:
            assert s.logprobs == []  # nothing computed for it
            continue
        assert len(s.logprobs) == 6
        for step, ((chosen, top_ids, top_lps), theirs) in enumerate(
                zip(s.logprobs, hf_logprobs(ref, PROMPTS[i], s.output_token_ids), strict=True)):
            tok = s.output_token_ids[step]
            assert abs(chosen - float(theirs[tok])) < 1e-4, f"prompt {i} step {step}"
            vals, ids = torch.topk(theirs, 5)
            assert torch.allclose(torch.tensor(top_lps), vals, atol=1e-4), f"prompt {i} step {step}"
            # the same ids unless two of them are within the tolerance of each other
            if (vals[:-1] - vals[1:]).min() > 1e-4:
                assert top_ids == ids.tolist()
            if temperature == 0:
                assert tok == top_ids[0]
    eng.shutdown()


def test_logprobs_are_session_state():
    s = SessionState("s1", [1, 2], SamplingParams(logprobs=2), output_token_ids=[3],
                     logprobs=[[-0.25, [3, 4], [-0.25, -1.5]]], api="chat", include_usage=True)
    again = SessionState.from_dict(s.to_dict())
    assert again == s
    # a checkpoint written before these fields existed still reads: missing = empty
    old = s.to_dict()
    for k in ("logprobs", "api", "include_usage"):
        del old[k]
    del old["sampling"]["logprobs"]
    back = SessionState.from_dict(old)
    assert (back.logprobs, back.api, back.include_usage, back.sampling.logprobs) == ([], "completion", False, None)


@pytest.fixture(scope="module")
def replica_and_gateway():
    rep = procs.replica()
    gw = None
    try:
        gw = procs.launch("gateway", "--replica", rep.url, "--port", "0")
        yield rep.url, gw.url
    finally:
        for p in (gw, rep):
            if p is not None:
                p.stop()


def test_completions_logprobs(replica_and_gateway):
    rep, gw = replica_and_gateway
    req = dict(model="builtin:tiny", prompt="The logprobs of ", max_tokens=12, temperature=0.9, seed=5, logprobs=3,
               extra_body={"ignore_eos": True})
    full = OpenAI(base_url=f"{rep}/v1", api_key="x", max_retries=0).completions.create(**req)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and top[tok] == chosen  # the chosen token is always among them
        assert 1 <= len(top) <= 4
    assert full.usage.prompt_tokens == len("The logprobs of ") and full.usage.completion_tokens == 12
    # streamed: the chunks' lists concatenate to the same thing; the usage chunk on request
    for base in (rep, gw):
        cl = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        usage = None
        for chunk in cl.completions.create(stream=True, stream_options={"include_usage": True}, **req):
            usage = chunk.usage or usage
            for c in chunk.choices:
                if c.logprobs is not None:
                    for k in got:
                        got[k] += getattr(c.logprobs, k)
        assert got == {k: getattr(lp, k) for k in got}, base
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (16, 12, 28)
        # not streamed, through the gateway too
        again = cl.completions.create(**req)
        assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs
        assert again.usage.total_tokens == 28
    # without logprobs: none, and the usage chunk only when asked for
    plain = httpx.post(f"{gw}/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}, timeout=30)
    assert '"logprobs": null' in plain.text and '"usage"' not in plain.text
    for base in (rep, gw):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "logprobs": 21}, timeout=30)
        assert r.status_code == 400 and "logprobs must be between 0 and 20" in r.json()["error"]["message"]
