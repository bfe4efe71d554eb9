"""/v1/chat/completions: templates rendered as transformers renders them, the request's checks, and
the official openai client against a replica and through the gateway across a live migration."""

import json
import threading

import httpx
import pytest
from openai import OpenAI
from relayout.engine.api.chat import ChatTemplate, load_chat_template
from relayout.engine.model.builtin import create_builtin
from relayout.engine.runtime.engine import RequestError
from relayout.migrate import procs
from relayout.migrate.protocol.live import migrate_live

# exercises what transformers' environment adds: namespace, loop controls, tojson, raise_exception,
# the generation tag, the special tokens, trim_blocks / lstrip_blocks
TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if m['role'] == 'system' %}{% continue %}{% endif %}
    {% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}{{ eos_token }}{% endgeneration %}
    {% else %}{{ m['role'] | upper }}: {{ m['content'] | tojson }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[{{ ns.n }}] A:{% endif %}"""

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo \"q\""},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}]


def test_template_renders_as_transformers():
    from transformers.utils.chat_template_utils import render_jinja_template

    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    ours = ChatTemplate(TEMPLATE, specials).render(MESSAGES)
    theirs = render_jinja_template([MESSAGES], chat_template=TEMPLATE, add_generation_prompt=True, **specials)[0][0]
    assert ours == theirs
    assert '"héllo \\"q\\""' in ours and ours.startswith("<s>") and ours.endswith("[4] A:")


def test_template_failures_are_request_errors():
    with pytest.raises(RequestError, match="failed to render: bad role tool"):
        ChatTemplate(TEMPLATE, {}).render([{"role": "tool", "content": "x"}])
    with pytest.raises(RequestError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", {}).render(MESSAGES)
    with pytest.raises(RequestError, match="failed to render"):  # the sandbox holds
        ChatTemplate("{{ messages.__class__.__mro__ }}", {}).render(MESSAGES)
    with pytest.raises(RequestError, match="failed to render"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", {}).render(MESSAGES)


def test_builtin_model_ships_a_template(tmp_path):
    d = create_builtin("tiny", tmp_path / "tiny")
    assert "chat_template" in json.loads((d / "tokenizer_config.json").read_text())
    assert load_chat_template(d).render(MESSAGES[1:2]) == '<|user|>\nhéllo "q"\n<|assistant|>\n'
    # transformers' newer layout: chat_template.jinja wins over tokenizer_config.json
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(d).render(MESSAGES) == "be brief"
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<B>"}, "chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ bos_token }}!"}]}))
    assert load_chat_template(d).render(MESSAGES) == "<B>!"
    (d / "tokenizer_config.json").unlink()
    assert load_chat_template(d) is None


@pytest.fixture(scope="module")
def fleet():
    started = []
    try:
        src = procs.replica()
        started.append(src)
        dst = procs.replica("attn_tp=2")
        started.append(dst)
        gw = procs.launch("gateway", "--replica", src.url, "--port", "0")
        started.append(gw)
        yield {"src": src.url, "dst": dst.url, "gw": gw.url}
    finally:
        for p in started:
            p.stop()


def client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


CHAT = dict(model="builtin:tiny", messages=[{"role": "system", "content": "You are terse."},
                                            {"role": "user", "content": "Tell me a story."}],
            temperature=0.8, seed=11, logprobs=True, top_logprobs=3)


def flat_logprobs(content) -> list[tuple]:
    return [(c.token, c.logprob, tuple(c.bytes), tuple((t.token, t.logprob) for t in c.top_logprobs))
            for c in content]


def stream_chat(base: str, req: dict, started: threading.Event | None = None) -> dict:
    text, ids, lps, usage, roles, finish = [], [], [], None, [], None
    for chunk in client(base).chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                      extra_body={"return_token_ids": True, "ignore_eos": True}, **req):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text.append(c.delta.content or "")
            ids += (c.model_extra or {}).get("token_ids") or []
            lps += flat_logprobs(c.logprobs.content) if c.logprobs and c.logprobs.content else []
            finish = c.finish_reason or finish
        if started is not None and len(ids) >= 5:
            started.set()
    return {"text": "".join(text), "ids": ids, "logprobs": lps, "usage": usage, "roles": roles, "finish": finish}


def assert_same_logprobs(got: list[tuple], ref: list[tuple], tol: float = 1e-4):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert (a[0], a[2]) == (b[0], b[2]), f"token {i}"
        assert abs(a[1] - b[1]) < tol, f"token {i}: {a[1]} vs {b[1]}"
        assert [t for t, _ in a[3]] == [t for t, _ in b[3]], f"token {i} top tokens"
        assert all(abs(x - y) < tol for (_, x), (_, y) in zip(a[3], b[3], strict=True)), f"token {i} top values"


def test_chat_streamed_and_not_agree(fleet):
    req = {**CHAT, "max_tokens": 24}
    full = client(fleet["src"]).chat.completions.create(extra_body={"return_token_ids": True, "ignore_eos": True}, **req)
    c = full.choices[0]
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert c.message.role == "assistant" and c.finish_reason == "length"
    assert len(c.logprobs.content) == 24 and all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
    # the chosen token is never likelier than the first of the top 3
    assert all(t.logprob <= t.top_logprobs[0].logprob + 1e-6 for t in c.logprobs.content)
    # the prompt is the builtin template's rendering: byte tokens, no specials added
    rendered = "<|system|>\nYou are terse.\n<|user|>\nTell me a story.\n<|assistant|>\n"
    assert full.usage.prompt_tokens == len(rendered.encode()) and full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    s = stream_chat(fleet["src"], req)
    assert s["roles"] == ["assistant"] and s["finish"] == "length"
    assert s["text"] == c.message.content and s["ids"] == c.model_extra["token_ids"]
    assert s["logprobs"] == flat_logprobs(c.logprobs.content)
    assert (s["usage"].prompt_tokens, s["usage"].completion_tokens) == (full.usage.prompt_tokens, 24)
    # OpenAI's list-of-text-parts content is the same message
    parts = {**req, "messages": [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
                                 req["messages"][1]]}
    again = client(fleet["src"]).chat.completions.create(extra_body={"ignore_eos": True}, **parts)
    assert again.choices[0].message.content == c.message.content
    # and through the gateway, not streamed
    via = client(fleet["gw"]).chat.completions.create(extra_body={"ignore_eos": True}, **req)
    assert via.choices[0].message.content == c.message.content
    assert flat_logprobs(via.choices[0].logprobs.content) == flat_logprobs(c.logprobs.content)
    assert via.usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.parametrize("body, reason", [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "needs logprobs"),
    ({}, "messages: Field required"),
    ({"messages": []}, "must not be empty"),
    ({"messages": [{"role": "user", "content": 7}]}, "content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "content must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens must be"),
])
def test_chat_bad_requests(fleet, body, reason):
    for base in (fleet["src"], fleet["gw"]):
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert reason in r.json()["error"]["message"]


def test_chat_stream_through_gateway_survives_live_migration(fleet):
    req = {**CHAT, "max_tokens": 300}
    ref = stream_chat(fleet["dst"], req)  # undisturbed, on the target's layout
    got: dict = {}
    started = threading.Event()

    def run():
        try:
            got["out"] = stream_chat(fleet["gw"], req, started)
        except Exception as e:  # noqa: BLE001 - asserted below
            got["out"] = e

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60)
    res = migrate_live(fleet["src"], fleet["dst"])
    t.join(120)
    out = got["out"]
    assert not isinstance(out, Exception), out
    assert len(res.sessions) == 1  # it moved mid-stream (attn_dp=1 -> attn_tp=2)
    assert out["ids"] == ref["ids"] and out["text"] == ref["text"] and len(out["ids"]) == 300
    assert out["roles"] == ["assistant"] and out["finish"] == "length"
    assert_same_logprobs(out["logprobs"], ref["logprobs"])
    assert (out["usage"].prompt_tokens, out["usage"].completion_tokens) == (ref["usage"].prompt_tokens, 300)
