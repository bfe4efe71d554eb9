"""Client API keys and error shapes on the gateway and the replica (docs/gateway.md, docs/replica-api.md):
a real replica and real gateways over loopback, the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI
from relayout.migrate import procs

from tests.helpers.sse import sse, token_ids

REPLICA_KEY, GATEWAY_KEY, TOKEN = "replica-client-key", "gateway-client-key", "replica-token"


@pytest.fixture(scope="module")
def keyed():
    """A replica with a client key and a token; a gateway with its own client key that reaches the replica with
    the token; a second gateway without the token that passes its client's key on."""
    rep = procs.replica(args=("--api-key", REPLICA_KEY), env={"RELAYOUT_TOKEN": TOKEN, "RELAYOUT_API_KEYS": None},
                        timeout=60)
    gws = []
    try:
        gws.append(procs.gateway("--replica", rep.url, "--port", "0", "--api-key", GATEWAY_KEY,
                                 env={"RELAYOUT_TOKEN": TOKEN}, timeout=60))
        gws.append(procs.gateway("--replica", rep.url, "--port", "0",
                                 env={"RELAYOUT_TOKEN": None, "RELAYOUT_API_KEYS": f"other,{REPLICA_KEY}"}, timeout=60))
        yield rep.url, gws[0].url, gws[1].url
    finally:
        for g in gws:
            g.stop()
        rep.stop()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key" and err["message"]


def test_replica_client_routes_need_a_key_and_the_token_routes_stay_the_tokens(keyed):
    rep, _, _ = keyed
    assert httpx.get(f"{rep}/health").status_code == 200  # health and metrics stay open
    for key in (None, "wrong", GATEWAY_KEY):
        h = bearer(key) if key else {}
        assert_openai_401(httpx.get(f"{rep}/v1/models", headers=h))
        assert_openai_401(httpx.post(f"{rep}/v1/completions", headers=h, json={"prompt": "x", "max_tokens": 2}))
        assert_openai_401(httpx.get(f"{rep}/v1/sessions/cmpl-x", headers=h))
        assert_openai_401(httpx.post(f"{rep}/v1/sessions/cmpl-x/abort", headers=h))
    assert httpx.get(f"{rep}/v1/models", headers=bearer(REPLICA_KEY)).status_code == 200
    assert httpx.get(f"{rep}/v1/models", headers=bearer(TOKEN)).status_code == 200  # relayout's own callers
    # a client key never opens a route that needs the replica token
    r = httpx.post(f"{rep}/v1/sessions/checkpoint", headers=bearer(REPLICA_KEY), json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    c = OpenAI(base_url=f"{rep}/v1", api_key=REPLICA_KEY, max_retries=0)
    out = c.completions.create(model="builtin:tiny", prompt="hello", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length"
    r = httpx.post(f"{rep}/v1/sessions/{out.id}/abort", headers=bearer(REPLICA_KEY))
    assert r.status_code == 200  # finished already: a no-op
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{rep}/v1", api_key="wrong", max_retries=0).models.list()


def test_gateway_takes_its_own_client_keys_and_reaches_replicas_with_the_token(keyed):
    rep, gw, _ = keyed
    for key in (None, "wrong", REPLICA_KEY, TOKEN):  # neither the replica's key nor the token is a gateway key
        h = bearer(key) if key else {}
        assert_openai_401(httpx.post(f"{gw}/v1/completions", headers=h, json={"prompt": "x", "max_tokens": 2}))
        assert_openai_401(httpx.get(f"{gw}/v1/sessions/cmpl-x/stream", headers=h))
    c = OpenAI(base_url=f"{gw}/v1", api_key=GATEWAY_KEY, max_retries=0)
    assert c.models.list().data[0].id == "builtin:tiny"
    full = c.completions.create(model="builtin:tiny", prompt="the gateway", max_tokens=12, temperature=0,
                                extra_body={"return_token_ids": True, "ignore_eos": True})
    streamed = [x for x in c.completions.create(model="builtin:tiny", prompt="the gateway", max_tokens=12,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(x.choices[0].text for x in streamed if x.choices) == full.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    # the session is found through the gateway, and its stream replayed from any token
    info = httpx.get(f"{gw}/v1/sessions/{full.id}", headers=bearer(GATEWAY_KEY)).json()
    assert info["state"] == "finished" and info["token_ids"] == full.choices[0].model_extra["token_ids"]
    assert info["replica"] == rep.rstrip("/")
    with httpx.stream("GET", f"{gw}/v1/sessions/{full.id}/stream", headers=bearer(GATEWAY_KEY),
                      params={"from_token": 5, "return_token_ids": "true"}) as r:
        events, done = sse(r.iter_lines())
    assert done
    ids = [i for ev in events for i in token_ids(ev)]
    assert ids == info["token_ids"][5:]
    # chat passes through
    chat = c.chat.completions.create(model="builtin:tiny", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=6, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.object == "chat.completion"


def test_gateway_errors_are_openai_shaped(keyed):
    _, gw, _ = keyed
    h = bearer(GATEWAY_KEY)
    for method, path in (("GET", "/v1/nope"), ("GET", "/nope"), ("GET", "/v1/sessions/cmpl-unknown"),
                         ("GET", "/v1/sessions/cmpl-unknown/stream")):
        r = httpx.request(method, f"{gw}{path}", headers=h)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["type"] == "not_found_error" and r.json()["error"]["code"] == 404
    r = httpx.get(f"{gw}/v1/sessions/cmpl-x/stream", headers=h, params={"from_token": -1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    for path in ("/v1/completions", "/v1/chat/completions"):  # the gateway passes bodies on: it checks only their shape
        for body, says in ((b"{nope", "not valid JSON"), (b"[1, 2]", "must be a JSON object")):
            r = httpx.post(f"{gw}{path}", headers=h, content=body)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)
            assert says in r.json()["error"]["message"], (path, r.text)
    r = httpx.delete(f"{gw}/v1/completions", headers=h)
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_gateway_without_a_token_passes_the_clients_key_on(keyed):
    _, _, gw = keyed
    c = OpenAI(base_url=f"{gw}/v1", api_key=REPLICA_KEY, max_retries=0)
    out = c.completions.create(model="builtin:tiny", prompt="pass it on", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{gw}/v1", api_key="wrong", max_retries=0).completions.create(
            model="builtin:tiny", prompt="x", max_tokens=2)
