"""The gateway as a stateless front door (docs/gateway.md): real agents, replicas and gateways over loopback.

A gateway kill -9'd mid-stream loses no session (clients reattach on a new gateway at token K); a session
checkpointed with stop tells its direct client (finish_reason "checkpointed") and its gateway stream
continues with identical tokens once it is restored on another agent; a stream whose replica dies is
held until a restore brings the session back; a client hang-up through the gateway (streamed or not) aborts
at once; a bare disconnect detaches for the grace; past the reattach bound the client gets an error event."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from relayout.migrate import procs

from tests.helpers.agents import TOKEN, H, start_agent, stop, wait_op
from tests.helpers.faults import kill_tree
from tests.helpers.sse import DONE, sse_data, token_ids

MODEL = "builtin:tiny"


def request(i: int, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": f"reattach {i}: once upon a time", "max_tokens": max_tokens,
            "temperature": 0.8, "seed": 100 + i, "ignore_eos": True, "return_token_ids": True}


class Reader:
    """One SSE stream read by hand, so a test decides when to stop reading (or hang up)."""

    def __init__(self, method: str, url: str, **kw):
        self.client = httpx.Client(timeout=120)
        self.cm = self.client.stream(method, url, **kw)
        self.resp = self.cm.__enter__()
        assert self.resp.status_code == 200, self.resp.read()
        self.events_left = sse_data(self.resp.iter_lines())  # read on, a call at a time
        self.sid, self.ids, self.finish, self.events, self.done = None, [], None, [], False

    def read(self, until_tokens: int | None = None) -> Reader:
        for ev in self.events_left:
            if ev == DONE:
                self.done = True
                break
            assert isinstance(ev, dict)
            self.events.append(ev)
            self.sid = ev.get("id", self.sid)
            self.ids += token_ids(ev)
            self.finish = next((c["finish_reason"] for c in ev.get("choices", []) if c.get("finish_reason")),
                               self.finish)
            if until_tokens is not None and len(self.ids) >= until_tokens:
                break
        return self

    def close(self) -> None:
        self.cm.__exit__(None, None, None)
        self.client.close()


def reference(replica_url: str, req: dict) -> list[int]:
    """The same request's tokens, not streamed, run undisturbed (seeded: identical by contract)."""
    r = httpx.post(f"{replica_url}/v1/completions", json=req, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def wait_for(fn, timeout: float = 60, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout}s")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Agents A and B with one replica each; checkpoints under a root both may read."""
    tmp = tmp_path_factory.mktemp("reattach")
    mp = pytest.MonkeyPatch()
    mp.setenv("RELAYOUT_TOKEN", TOKEN)
    mp.setenv("RELAYOUT_FILE_ROOTS", str(tmp))
    mp.delenv("RELAYOUT_DETACH_GRACE_S", raising=False)  # the default 60 s: an abort seen sooner was explicit
    children = []
    try:
        agents = {}
        for name in ("a", "b"):
            p, url = start_agent(tmp / name, tmp / f"{name}.log")
            children.append(p)
            r = httpx.post(f"{url}/v1/replicas", headers=H, json={"model": MODEL, "layout": "attn_dp=1"}, timeout=200)
            assert r.status_code == 201, r.text
            agents[name] = {"url": url, "replica": r.json()["id"], "replica_url": r.json()["url"].rstrip("/")}
        yield {"agents": agents, "tmp": tmp}
    finally:
        for p in reversed(children):
            stop(p)
        mp.undo()


def start_gateway(fleet, *extra: str, env: dict | None = None) -> procs.Proc:
    a, b = fleet["agents"]["a"]["url"], fleet["agents"]["b"]["url"]
    return procs.gateway("--agent", a, "--agent", b, "--port", "0", *extra, env=env, timeout=60)


def owner(fleet, replica_url: str) -> dict:
    return next(ag for ag in fleet["agents"].values() if ag["replica_url"] == replica_url.rstrip("/"))


def test_gateway_killed_mid_stream_clients_reattach_on_a_new_gateway(fleet):
    gw1 = start_gateway(fleet)
    reqs = [request(i, 300) for i in range(3)]
    readers = []
    try:
        readers = [Reader("POST", f"{gw1.url}/v1/completions", json={**q, "stream": True}) for q in reqs]
        for rd in readers:
            rd.read(until_tokens=8)
            assert len(rd.ids) >= 8 and not rd.done
        gw1.kill()  # kill -9: no abort is sent; each replica sees a bare disconnect and detaches the session
    finally:
        for rd in readers:
            rd.close()
    gw2 = start_gateway(fleet)
    try:
        for q, rd in zip(reqs, readers, strict=True):
            info = httpx.get(f"{gw2.url}/v1/sessions/{rd.sid}").json()
            assert info["state"] in ("running", "finished") and info.get("finish_reason") != "abort", info
            k = len(rd.ids)
            rest = Reader("GET", f"{gw2.url}/v1/sessions/{rd.sid}/stream",
                          params={"from_token": k, "return_token_ids": "true"}).read()
            rest.close()
            assert rest.done and rest.finish == "length"
            ref = reference(info["replica"], {**q, "prompt": q["prompt"]})
            assert rd.ids + rest.ids == ref  # exactly the remaining tokens: none lost, repeated or changed
        r = httpx.get(f"{gw2.url}/v1/sessions/nope-nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    finally:
        gw2.stop()


def test_checkpoint_with_stop_then_restore_on_another_agent_continues_the_gateway_stream(fleet):
    gw = start_gateway(fleet)
    q = request(10, 1500)
    rd = Reader("POST", f"{gw.url}/v1/completions", json={**q, "stream": True})
    direct = None
    try:
        rd.read(until_tokens=6)
        where = httpx.get(f"{gw.url}/v1/sessions/{rd.sid}").json()["replica"]
        src = owner(fleet, where)
        dst = next(ag for ag in fleet["agents"].values() if ag is not src)
        direct = Reader("GET", f"{where}/v1/sessions/{rd.sid}/stream", params={"return_token_ids": "true"})
        r = httpx.post(f"{src['url']}/v1/replicas/{src['replica']}/checkpoint", headers=H, json={"stop": True})
        op = wait_op(src["url"], r.json()["operation_id"])
        assert op["state"] == "succeeded", op
        uri = op["result"]["checkpoint"]
        # the direct client is told where its session went
        direct.read()
        assert direct.done and direct.finish == "checkpointed"
        s = httpx.get(f"{where}/v1/sessions/{rd.sid}").json()
        assert s["state"] == "checkpointed" and s["checkpoint"] == uri and len(s["token_ids"]) < 1500
        g = httpx.get(f"{gw.url}/v1/sessions/{rd.sid}").json()
        assert g["state"] == "checkpointed" and g["checkpoint"] == uri
        time.sleep(1.0)  # the gateway stream is held meanwhile, not ended
        r = httpx.post(f"{dst['url']}/v1/restore", headers=H, json={"checkpoint": uri, "replica": dst["replica"]})
        op = wait_op(dst["url"], r.json()["operation_id"])
        assert op["state"] == "succeeded" and rd.sid in op["result"]["sessions"], op
        rd.read()
        assert rd.done and rd.finish == "length"
        assert not any(c.get("finish_reason") == "checkpointed" for ev in rd.events for c in ev.get("choices", []))
        assert rd.ids == reference(dst["replica_url"], q)  # identical tokens across the checkpoint and restore
        assert httpx.get(f"{gw.url}/v1/sessions/{rd.sid}").json()["replica"] == dst["replica_url"]
    finally:
        rd.close()
        if direct is not None:
            direct.close()
        gw.stop()


def test_client_hang_up_through_the_gateway_aborts_at_once(fleet):
    gw = start_gateway(fleet)
    try:
        rd = Reader("POST", f"{gw.url}/v1/completions", json={**request(20, 3000), "stream": True}).read(until_tokens=4)
        sid = rd.sid
        rd.close()  # the replica's detach grace is 60 s here: an abort within seconds is the gateway's
        info = wait_for(lambda: (lambda s: s if s["state"] == "finished" else None)(
            httpx.get(f"{gw.url}/v1/sessions/{sid}").json()), 20, "abort")
        assert info["finish_reason"] == "abort" and len(info["token_ids"]) < 3000

        # not streamed: the client gives up waiting for the whole answer and hangs up
        def sessions() -> set[str]:
            return {s["id"] for ag in fleet["agents"].values()
                    for s in httpx.get(f"{ag['replica_url']}/v1/replica", headers=H).json()["sessions"]}

        before = sessions()
        hung_up: list[BaseException] = []

        def give_up() -> None:
            try:
                httpx.post(f"{gw.url}/v1/completions", json=request(21, 3000), timeout=httpx.Timeout(60, read=2))
            except BaseException as e:  # noqa: BLE001 - asserted below
                hung_up.append(e)

        client = threading.Thread(target=give_up)
        client.start()
        # the session's id, seen while it runs (once aborted it may leave the replica's list)
        (sid,) = wait_for(lambda: sessions() - before or None, 20, "the non-streamed session")
        client.join(30)
        assert len(hung_up) == 1 and isinstance(hung_up[0], httpx.ReadTimeout), hung_up
        info = wait_for(lambda: (lambda s: s if s["state"] == "finished" else None)(
            httpx.get(f"{gw.url}/v1/sessions/{sid}").json()), 20, "abort")
        assert info["finish_reason"] == "abort" and len(info["token_ids"]) < 3000
    finally:
        gw.stop()


def test_stream_whose_replica_dies_is_held_until_a_restore_brings_the_session_back(fleet):
    """Last: it kills A's or B's replica. A checkpoint without stop, then the replica dies; the session is
    restored (behind by some tokens) on the other agent; the gateway stream waits for it to catch up to
    what the client already has and continues with identical tokens."""
    gw = start_gateway(fleet)
    q = request(30, 1200)
    rd = Reader("POST", f"{gw.url}/v1/completions", json={**q, "stream": True})
    try:
        rd.read(until_tokens=5)
        where = httpx.get(f"{gw.url}/v1/sessions/{rd.sid}").json()["replica"]
        src = owner(fleet, where)
        dst = next(ag for ag in fleet["agents"].values() if ag is not src)
        r = httpx.post(f"{src['url']}/v1/replicas/{src['replica']}/checkpoint", headers=H, json={})
        op = wait_op(src["url"], r.json()["operation_id"])
        assert op["state"] == "succeeded", op
        rd.read(until_tokens=len(rd.ids) + 20)  # the client gets ahead of the checkpoint
        kill_tree(httpx.get(f"{src['url']}/v1/replicas/{src['replica']}", headers=H).json()["pid"])
        time.sleep(1.0)
        r = httpx.post(f"{dst['url']}/v1/restore", headers=H,
                       json={"checkpoint": op["result"]["checkpoint"], "replica": dst["replica"]})
        assert wait_op(dst["url"], r.json()["operation_id"])["state"] == "succeeded"
        rd.read()
        assert rd.done and rd.finish == "length" and not any("error" in ev for ev in rd.events)
        assert rd.ids == reference(dst["replica_url"], q)
    finally:
        rd.close()
        gw.stop()


# ---- one replica of its own: detach grace, and the reattach bound ---------------------------------
@pytest.fixture(scope="module")
def solo():
    # a 2 s grace: long after the 1 s a test waits to see a detached session still running, and too short
    # for a 4000-token session to finish first (at 3 s and 3000 tokens, one ended by length on a fast machine)
    rep = procs.replica(env={"RELAYOUT_DETACH_GRACE_S": "2", "RELAYOUT_TOKEN": None}, timeout=60)
    gw = procs.gateway("--replica", rep.url, "--port", "0", env={"RELAYOUT_REATTACH_WAIT_S": "3",
                                                                 "RELAYOUT_TOKEN": None}, timeout=60)
    try:
        yield rep, gw
    finally:
        gw.stop()
        rep.stop()


def test_bare_disconnect_detaches_for_the_grace_then_aborts(solo):
    rep, _ = solo
    q = request(40, 500)
    rd = Reader("POST", f"{rep.url}/v1/completions", json={**q, "stream": True}).read(until_tokens=5)
    rd.close()  # a bare disconnect: no abort call
    time.sleep(1.0)
    s = httpx.get(f"{rep.url}/v1/sessions/{rd.sid}").json()
    assert s["finish_reason"] != "abort", s  # detached, keeping its place
    rest = Reader("GET", f"{rep.url}/v1/sessions/{rd.sid}/stream",
                  params={"from_token": len(rd.ids), "return_token_ids": "true"}).read()
    rest.close()
    assert rest.done and rd.ids + rest.ids == reference(rep.url, q)
    # nobody reattaches: aborted after the grace, its blocks freed
    rd = Reader("POST", f"{rep.url}/v1/completions", json={**request(41, 4000), "stream": True}).read(until_tokens=5)
    rd.close()
    time.sleep(1.0)
    assert httpx.get(f"{rep.url}/v1/sessions/{rd.sid}").json()["state"] == "running"
    s = wait_for(lambda: (lambda s: s if s["state"] == "finished" else None)(
        httpx.get(f"{rep.url}/v1/sessions/{rd.sid}").json()), 15, "abort after the grace")
    assert s["finish_reason"] == "abort" and len(s["token_ids"]) < 4000
    assert wait_for(lambda: httpx.get(f"{rep.url}/v1/replica").json()["kv_blocks_used"] == 0, 10, "blocks freed")


def test_explicit_abort_route(solo):
    rep, _ = solo
    rd = Reader("POST", f"{rep.url}/v1/completions", json={**request(42, 3000), "stream": True}).read(until_tokens=3)
    try:
        r = httpx.post(f"{rep.url}/v1/sessions/{rd.sid}/abort")
        assert r.status_code == 200 and r.json()["aborted"] is True
        rd.read()
        assert rd.done and rd.finish == "abort"
        assert httpx.post(f"{rep.url}/v1/sessions/nope/abort").status_code == 404
    finally:
        rd.close()


def test_session_that_never_comes_back_ends_with_an_error_event(solo):
    """Last of the solo tests: it kills the replica."""
    rep, gw = solo
    rd = Reader("POST", f"{gw.url}/v1/completions", json={**request(43, 3000), "stream": True}).read(until_tokens=3)
    try:
        kill_tree(rep.pid)
        rep.kill()  # reaped
        t = time.monotonic()
        try:
            rd.read()
        except httpx.HTTPError as e:  # the gateway cut the stream: what it printed says why
            raise AssertionError(f"the gateway's stream broke ({e}); gateway output:\n{gw.output()[-4000:]}") from e
        errors = [ev["error"] for ev in rd.events if "error" in ev]
        assert rd.done and errors and errors[0]["code"] == 504 and rd.sid in errors[0]["message"], \
            (rd.events[-2:], gw.output()[-4000:])
        assert time.monotonic() - t < 30
    finally:
        rd.close()
