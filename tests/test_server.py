"""The replica HTTP API end to end (a real replica server subprocess), plus AsyncEngine itself."""

import asyncio
import json
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from relayout.engine.runtime.async_engine import AsyncEngine, EngineDeadError
from relayout.engine.runtime.engine import LLMEngine, RequestError
from relayout.engine.runtime.session import SamplingParams, SessionStatus
from relayout.migrate import procs

from tests.helpers.sse import sse as sse_events

KV_MB = 1  # builtin:tiny: 512 B/token → 2048 tokens, so an over-long request is cheap to make


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    # a bare disconnect detaches a session for the grace, then aborts it: 0.2 s here (tests/test_reattach.py
    # checks the reattach within the grace); at 1 s a fast machine generated all of
    # test_disconnect_frees_blocks_and_metrics's 1500 tokens within it, and the session ended by length
    proc = procs.replica(env={"OMP_NUM_THREADS": "1", "RELAYOUT_DETACH_GRACE_S": "0.2"}, args=args, timeout=60)
    return proc.p, proc.url


@pytest.fixture(scope="module")
def server():
    p, url = start_server("--kv-cache-mb", str(KV_MB))
    yield url
    p.terminate()
    p.wait(10)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)


def greedy(**kw):
    return {"model": "builtin:tiny", "temperature": 0, "max_tokens": 24, **kw}


def test_models(server):
    r = httpx.get(server + "/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "builtin:tiny"


def test_openai_client_stream_equals_nonstream(client):
    req = greedy(prompt="The quick brown fox", extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.completions.create(**req)
    ch = full.choices[0]
    ids = ch.model_extra["token_ids"]
    assert len(ids) == 24 and ch.finish_reason == "length" and full.usage.completion_tokens == 24
    text, sids = "", []
    for chunk in client.completions.create(**req, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            sids += chunk.choices[0].model_extra.get("token_ids") or []
            last = chunk.choices[0].finish_reason
    assert text == ch.text and sids == ids and last == "length"
    assert chunk.id.startswith("cmpl-") and chunk.id != full.id


def test_token_id_prompt_forms_and_stop(client, server):
    a = client.completions.create(**greedy(prompt=[72, 105, 33], extra_body={"return_token_ids": True}))
    b = client.completions.create(**greedy(prompt=[[72, 105, 33]], extra_body={"return_token_ids": True}))
    c = client.completions.create(**greedy(prompt=["Hi!"], extra_body={"return_token_ids": True}))
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text
    full = a.choices[0].text
    # a stop string taken from the middle of the output truncates the text right before it
    cut = next(i for i in range(2, len(full) - 2)
               if full[i:i + 2].isascii() and full[i:i + 2].isprintable() and full[i:i + 2] not in full[:i])
    stop = full[cut:cut + 2]
    s = client.completions.create(**greedy(prompt=[72, 105, 33], stop=[stop, "never"]))
    assert s.choices[0].text == full[:cut] and s.choices[0].finish_reason == "stop"
    streamed = "".join(x.choices[0].text for x in client.completions.create(
        **greedy(prompt=[72, 105, 33], stop=stop), stream=True) if x.choices)
    assert streamed == full[:cut]


def test_concurrent_streams_match_alone(client):
    prompts = [f"request number {i}: " + "ab" * i for i in range(16)]
    alone = [client.completions.create(**greedy(prompt=p, extra_body={"return_token_ids": True, "ignore_eos": True}))
             .choices[0].model_extra["token_ids"] for p in prompts]

    def stream(p):
        ids = []
        for chunk in client.completions.create(**greedy(prompt=p, stream=True,
                                                          extra_body={"return_token_ids": True, "ignore_eos": True})):
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
        return ids

    with ThreadPoolExecutor(16) as ex:
        together = list(ex.map(stream, prompts))
    assert together == alone


def sse(resp_or_lines) -> tuple[list[dict], bool]:
    return sse_events(resp_or_lines.iter_lines() if isinstance(resp_or_lines, httpx.Response) else resp_or_lines)


def test_session_get_and_resumed_stream(server):
    r = httpx.post(server + "/v1/completions", json=greedy(prompt="resume me", return_token_ids=True, ignore_eos=True))
    body = r.json()
    sid, ids, text = body["id"], body["choices"][0]["token_ids"], body["choices"][0]["text"]
    s = httpx.get(f"{server}/v1/sessions/{sid}").json()
    assert s["id"] == sid and s["state"] == "finished" and s["finish_reason"] == "length"
    assert s["token_ids"] == ids and s["prompt_token_ids"] == list(b"resume me")
    lean = httpx.get(f"{server}/v1/sessions/{sid}", params={"token_ids": "false"}).json()
    assert "token_ids" not in lean and "prompt_token_ids" not in lean
    assert (lean["num_generated_tokens"], lean["num_prompt_tokens"]) == (len(ids), len(b"resume me")) == (
        s["num_generated_tokens"], s["num_prompt_tokens"])
    for k in (0, 5, 23, 24):
        with httpx.stream("GET", f"{server}/v1/sessions/{sid}/stream",
                          params={"from_token": k, "return_token_ids": "true"}) as resp:
            assert resp.status_code == 200
            events, done = sse(resp)
        assert done
        assert [t for e in events for t in e["choices"][0].get("token_ids", [])] == ids[k:]
        tail = "".join(e["choices"][0]["text"] for e in events)
        assert text.endswith(tail) and (k > 0 or tail == text)


def test_resume_past_the_generated_tokens_waits_for_them(server):
    with httpx.stream("POST", server + "/v1/completions",
                      json=greedy(prompt="live", max_tokens=80, stream=True, ignore_eos=True)) as resp:
        lines = resp.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        sid = first["id"]
        with httpx.stream("GET", f"{server}/v1/sessions/{sid}/stream",
                          params={"from_token": 60, "return_token_ids": "true"}) as r2:
            events, done = sse(r2)
        rest, _ = sse(lines)
    full = "".join(e["choices"][0]["text"] for e in [first, *rest])
    s = httpx.get(f"{server}/v1/sessions/{sid}").json()
    assert done and [t for e in events for t in e["choices"][0]["token_ids"]] == s["token_ids"][60:]
    assert full.endswith("".join(e["choices"][0]["text"] for e in events))


def test_stop_text_hold_back():
    from relayout.engine.api.server import StopTextStream
    from relayout.engine.model.tokenizer import ByteTokenizer

    ts = StopTextStream(ByteTokenizer(), ["abc", "zz"])
    assert ts.add(list(b"xxab")) == "xx"  # "ab" may start "abc": held back
    assert ts.add(list(b"d")) == "abd"
    assert ts.add(list(b"z")) == ""
    assert ts.add(list(b"q")) == "zq"
    assert ts.add(list(b"12abc34")) == "12" and ts.stopped and ts.finish() == ""
    t2 = StopTextStream(ByteTokenizer(), ["abc"])
    assert t2.add(list(b"xa")) == "x" and t2.finish() == "a"


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": 12.5}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x" * 3000}, "context"),
    ({"prompt": "x" * 100, "max_tokens": 2000}, "context"),  # the cache can never hold it: refused, not queued
    ({"prompt": [999999]}, "token"),
    ({"max_tokens": 3}, "prompt"),
])
def test_bad_requests_are_400(server, body, needle):
    r = httpx.post(server + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == 400 and "Traceback" not in r.text


def test_malformed_json_and_unknown_session(server):
    r = httpx.post(server + "/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for path in ("/v1/sessions/nope", "/v1/sessions/nope/stream"):
        r = httpx.get(server + path)
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]


def test_oversized_body_is_413(server):
    r = httpx.post(server + "/v1/completions", content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200  # and the replica keeps serving


def test_disconnect_frees_blocks_and_metrics(server):
    with httpx.stream("POST", server + "/v1/completions",
                      json=greedy(prompt="long one", max_tokens=1500, stream=True, ignore_eos=True)) as resp:
        it = resp.iter_lines()
        first = next(line for line in it if line.startswith("data: "))
        sid = json.loads(first[6:])["id"]
        assert httpx.get(server + "/v1/replica").json()["kv_blocks_used"] > 0
    deadline = time.time() + 10
    while time.time() < deadline:
        rep = httpx.get(server + "/v1/replica").json()
        if rep["kv_blocks_used"] == 0:
            break
        time.sleep(0.1)
    assert rep["kv_blocks_used"] == 0 and rep["sessions"] == []
    s = httpx.get(f"{server}/v1/sessions/{sid}").json()
    assert s["state"] == "finished" and s["finish_reason"] == "abort" and len(s["token_ids"]) < 1500
    assert rep["layout"]["attn_dp"] == 1 and len(rep["expert_counts"]) == 2
    assert rep["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 4  # tiny, float32: layers x KV heads x dims x K,V
    m = httpx.get(server + "/metrics").text
    assert "relayout_tokens_generated_total" in m and 'relayout_expert_tokens_total{expert="0",layer="0"}' in m
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_sigterm_exits_cleanly():
    p, url = start_server()
    with httpx.stream("POST", url + "/v1/completions",
                      json=greedy(prompt="x", max_tokens=1000, stream=True, ignore_eos=True)) as resp:
        next(resp.iter_lines())
        p.send_signal(signal.SIGTERM)  # with a stream still open
        t = time.time()
        assert p.wait(10) == 0
    assert time.time() - t < 8


# ---- AsyncEngine directly -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine():
    return LLMEngine("builtin:tiny", num_blocks=64)


def test_async_engine_call_and_stream(tiny_engine):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = tiny_engine.generate([[1, 2, 3]], params)[0]

    async def main():
        a = AsyncEngine(_NoShutdown(tiny_engine)).start()  # the engine is shared with the next test
        s = await a.submit([1, 2, 3], params)
        got = [t for b in [b async for b in a.stream(s.session_id)] for t in b]
        assert got == want and a.get(s.session_id)["state"] == "finished"
        late = [t for b in [b async for b in a.stream(s.session_id, from_token=7)] for t in b]
        assert late == want[7:]
        assert await a.call(lambda e: threading.current_thread().name) == "relayout-engine"
        with pytest.raises(RequestError):
            await a.submit([1], SamplingParams(max_tokens=10**6))
        with pytest.raises(ZeroDivisionError):
            await a.call(lambda e: 1 / 0)
        # the checkpoint/migration seam: at a step boundary, mark a running session migrated
        s2 = await a.submit([4, 5, 6], SamplingParams(max_tokens=1000, ignore_eos=True))
        st = a.stream(s2.session_id)
        first = await st.__anext__()
        await a.call(lambda e: e._finish(e.get(s2.session_id), "", SessionStatus.MIGRATED))
        rest = [b async for b in st]
        snap = a.get(s2.session_id)
        assert snap["state"] == "migrated" and len(first) + sum(map(len, rest)) == len(snap["token_ids"]) < 1000
        assert await a.call(lambda e: e.kv_blocks_used()) == 0
        assert a.healthy
        await a.stop()
        assert not a.healthy

    asyncio.run(asyncio.wait_for(main(), 60))


class _NoShutdown:
    def __init__(self, eng):
        self._eng = eng

    def shutdown(self):
        pass

    def __getattr__(self, k):
        return getattr(self._eng, k)


def test_async_engine_step_failure_fails_streams(tiny_engine):
    eng = _NoShutdown(tiny_engine)
    calls = {"n": 0}

    def bad_step():
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("rank 1 died")
        return tiny_engine.step()

    eng.step = bad_step

    async def main():
        a = AsyncEngine(eng).start()
        s = await a.submit([7, 8], SamplingParams(max_tokens=100, ignore_eos=True))
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            async for _ in a.stream(s.session_id):
                pass
        assert not a.healthy
        with pytest.raises(EngineDeadError):
            await a.call(lambda e: 1)
        with pytest.raises(EngineDeadError):
            async for _ in a.stream(s.session_id):
                pass
        await a.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
    for sid in list(tiny_engine.sessions):
        tiny_engine.abort(sid)
