"""Two bfloat16 replicas (`relayout serve --dtype bfloat16`, same layout) of a model whose chat template
refuses one input: sessions live-migrated between them continue token for token, and bad input is
answered 400 with the reason."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from relayout.engine.model.weights import resolve_model
from relayout.migrate import procs

from tests.helpers.migration import finish_moved, idle, migrate_with_streams, reference, replica_state

# the builtin template, plus a refusal a user's template may well contain
TEMPLATE = ("{% for message in messages %}{% if message['content'] == 'forbidden' %}"
            "{{ raise_exception('this template refuses the word forbidden') }}{% endif %}"
            "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
# Two sessions per migration, a greedy and a sampled one: in bf16 a session's tokens do not depend on
# which sessions share its steps (tests/test_batch_invariance.py), so the undisturbed reference of each
# is its solo run on the target, though on the source they ran together.
BODIES = [dict(prompt=f"bf16 request {i}: " + "xyz" * i, max_tokens=256, ignore_eos=True,
               **(dict(temperature=0.8, seed=40 + i) if i % 2 else dict(temperature=0.0))) for i in range(4)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = tmp_path_factory.mktemp("model") / "tiny-refusing-template"
    shutil.copytree(resolve_model("builtin:tiny"), model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    started = []
    try:
        for _ in range(2):
            started.append(procs.replica(None, None, str(model), ["--dtype", "bfloat16"]))
        yield [p.url for p in started]
    finally:
        for p in started:
            p.stop()


def test_bf16_live_migration_same_layout_token_for_token(pair):
    src, dst = pair
    for url in pair:
        info = replica_state(url)
        assert (info["dtype"], info["kv_dtype"]) == ("bfloat16", "auto")
    for bodies in (BODIES[:2], BODIES[2:]):  # there and back, two sessions each time
        refs = [reference(dst, b) for b in bodies]  # undisturbed, on the target, each alone
        m = migrate_with_streams(src, dst, [dst], bodies, max_rounds=2)  # a pre-copy round, then the final one
        finish_moved(m, refs, dst, src)
        assert m.result is not None and m.result.bytes_total > 0
        assert len(m.result.sessions) == len(bodies)  # both moved in one migration
        idle(src)
        src, dst = dst, src


@pytest.mark.parametrize("body, reason", [
    ({"messages": [{"role": "user", "content": "forbidden"}]},
     "the chat template failed to render: this template refuses the word forbidden"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "unknown role 'tool'"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs must be between 0 and 20, got 21"),
])
def test_bad_chat_input_is_400_with_the_reason(pair, body, reason):
    r = httpx.post(f"{pair[0]}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]
    # the same template renders other messages: the refusal was the template's, not a broken replica
    ok = httpx.post(f"{pair[0]}/v1/chat/completions", timeout=30,
                    json={"messages": [{"role": "user", "content": "allowed"}], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1, ok.text
