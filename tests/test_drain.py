"""Drain (docs/agent-api.md): 8 live openai streams through the gateway on 2 replicas of agent A; `POST /v1/drain`
moves them all to B; every stream ends with exactly the tokens of an undisturbed run; A refuses new
replicas and the gateway stops routing to it until undrain. Plus the agent's migrate route, end to end."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from openai import OpenAI
from relayout.migrate import procs

from tests.helpers.agents import TOKEN, H, lower_priority, start_agent, stop, wait_op

# long enough to outlive the targets' launch on a loaded 2-core machine (tiny decodes ~100 steps/s; its
# context limit is 4096 tokens)
REQS = [dict(prompt=f"drain {i}: " + "xyz" * (i % 4), max_tokens=3600 + 50 * i,
             **({"temperature": 0.8, "seed": 40 + i} if i % 2 else {"temperature": 0.0}))
        for i in range(8)]


PLANNED = {"placement": [[7, 6, 5, 4, 3, 2, 1, 0], [1, 0, 3, 2, 5, 4, 7, 6]]}  # builtin:tiny: 2 layers x 8 experts


def stream(base: str, req: dict, out: dict, key, started: threading.Event | None = None) -> None:
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    toks, sid = [], None
    try:
        for chunk in client.completions.create(model="builtin:tiny", stream=True,
                                               extra_body={"return_token_ids": True, "ignore_eos": True}, **req):
            sid = chunk.id
            c = chunk.choices[0]
            toks += (c.model_extra or {}).get("token_ids") or []
            if started is not None and len(toks) >= 3:
                started.set()
        out[key] = (sid, toks)
    except Exception as e:  # noqa: BLE001 - asserted below
        out[key] = e
    finally:
        if started is not None:
            started.set()


@pytest.fixture(scope="module")
def two_agents(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drain")
    mp = pytest.MonkeyPatch()
    mp.setenv("RELAYOUT_TOKEN", TOKEN)
    children = []
    try:
        pa, a = start_agent(tmp / "a", tmp / "a.log")
        children.append(pa)
        pb, b = start_agent(tmp / "b", tmp / "b.log")
        children.append(pb)
        reps = []
        for lay in ("attn_dp=1", "attn_dp=1,moe_ep=1"):  # world size 1: quick to relaunch on 2 CPU cores
            r = httpx.post(f"{a}/v1/replicas", headers=H, json={"model": "builtin:tiny", "layout": lay}, timeout=200)
            assert r.status_code == 201, r.text
            reps.append(r.json())
            # Two "nodes" on one 2-core machine: A's busy replicas would starve the launches of their
            # targets on B, which real hosts run on their own CPUs. A's replicas yield the CPU to B, so
            # their sessions are still running when the targets are up.
            lower_priority(httpx.get(f"{a}/v1/replicas/{reps[-1]['id']}", headers=H).json()["pid"], 10)
        gw = procs.gateway("--agent", a, "--agent", b, "--port", "0")
        children.append(gw.p)
        yield {"a": a, "b": b, "gw": gw.url, "replicas": reps}
    finally:
        for p in reversed(children):
            stop(p)
        mp.undo()


def test_drain_moves_every_stream_to_the_other_agent(two_agents):
    a, b, gw, reps = two_agents["a"], two_agents["b"], two_agents["gw"], two_agents["replicas"]
    r = httpx.post(f"{a}/v1/drain", headers=H, json={"target_agent": a})
    assert r.status_code == 400 and "this agent" in r.json()["error"]["message"]
    r = httpx.post(f"{a}/v1/drain", headers=H, json={"target_agent": "ftp://x"})
    assert r.status_code == 422

    got: dict = {}
    started = [threading.Event() for _ in REQS]
    ts = [threading.Thread(target=stream, args=(gw, q, got, i, started[i])) for i, q in enumerate(REQS)]
    for t in ts:
        t.start()
        time.sleep(0.05)
    # a planned layout for one replica's target is checked before anything starts
    for bad in ({"r-nope": "attn_dp=1"}, {reps[1]["id"]: "attn_tp=3"}, {"../x": "attn_dp=1"}):
        r = httpx.post(f"{a}/v1/drain", headers=H, json={"target_agent": b, "layouts": bad}, timeout=60)
        assert r.status_code == 400, r.text
    # so is a replica named to move into: it must run on the target, with the same model and engine
    for bad in ({"r-nope": "r-x"}, {reps[0]["id"]: "r-missing"}, {reps[0]["id"]: "../x"}):
        r = httpx.post(f"{a}/v1/drain", headers=H, json={"target_agent": b, "target_replicas": bad}, timeout=60)
        assert r.status_code == 400 and "target_replicas" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{a}/healthz").json()["draining"] is False
    for e in started:
        assert e.wait(90)
    assert not [got[i] for i in got if isinstance(got[i], Exception)], got
    info = [httpx.get(f"{a}/v1/replicas/{x['id']}", headers=H, timeout=60).json() for x in reps]
    per_replica = [len(x["sessions"]) for x in info]
    assert sum(per_replica) == len(REQS) and min(per_replica) > 0, info  # both replicas serve

    # replica 1 moves to the same layout, replica 2 to a planned one (its experts in another order)
    r = httpx.post(f"{a}/v1/drain", headers=H, json={"target_agent": b, "layouts": {reps[1]["id"]: PLANNED}},
                   timeout=60)
    assert r.status_code == 202, r.text
    oid = r.json()["operation_id"]
    assert httpx.post(f"{a}/v1/drain", headers=H, json={"target_agent": b}, timeout=60).status_code == 409
    # draining: no new replicas, and the replicas are flagged for the gateway at once
    r = httpx.post(f"{a}/v1/replicas", headers=H, json={"model": "builtin:tiny"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    listed = httpx.get(f"{a}/v1/replicas", headers=H).json()
    assert listed["draining"] and all(x["draining"] for x in listed["replicas"])
    t0 = time.monotonic()
    op = wait_op(a, oid, timeout=240)
    print(f"drain took {time.monotonic() - t0:.1f}s", {k: op[k] for k in ("bytes_done", "stall_ms")},
          [(x.get("launch_s"), x.get("move_s")) for x in op["result"]["replicas"]])
    # undisturbed reference, while B finishes the moved streams: the same requests straight to A's replicas
    # (still running, just not routed to)
    ref: dict = {}
    rts = [threading.Thread(target=stream, args=(reps[i % 2]["url"], q, ref, i)) for i, q in enumerate(REQS)]
    [t.start() for t in rts]
    for t in ts + rts:
        t.join(240)
    print(f"streams done {time.monotonic() - t0:.1f}s after the drain began")
    assert op["state"] == "succeeded", op
    res = op["result"]
    assert res["target_agent"] == b and res["sessions_not_moved"] == []
    assert [x["replica"] for x in res["replicas"]] == [x["id"] for x in reps]
    assert all(x["state"] == "drained" and x["target_replica"] for x in res["replicas"]), res

    # the same layout was launched on B for replica 1, the planned one for replica 2
    b_reps = {x["id"]: x for x in httpx.get(f"{b}/v1/replicas", headers=H).json()["replicas"]}
    got_layouts = [b_reps[moved["target_replica"]]["layout"] for moved in res["replicas"]]
    assert got_layouts[0] == reps[0]["layout"]
    assert got_layouts[1]["placement"] == PLANNED["placement"] and got_layouts[1] != reps[1]["layout"]

    moved_ids = {s for x in res["replicas"] for s in x["sessions_moved"]}
    finished_on_a = {s for x in res["replicas"] for s in x["sessions_finished_here"]}
    for i in range(len(REQS)):
        assert not isinstance(got[i], Exception), got[i]
        sid, toks = got[i]
        assert toks == ref[i][1], f"request {i}"
        if sid not in moved_ids:  # the result must still name it: it finished on A before its replica's turn
            assert sid in finished_on_a, (sid, res)
            pytest.fail(f"request {i} ({sid}) finished on A before the drain reached it (drain too slow: {op})")  # long sessions: every one was still running and moved
        tgt = next(x for x in res["replicas"] if sid in x["sessions_moved"])
        s = httpx.get(f"{b_reps[tgt['target_replica']]['url']}/v1/sessions/{sid}", headers=H).json()
        assert s["state"] == "finished" and s["token_ids"] == toks
    assert res["sessions_moved"] == len(REQS)

    # the gateway only offers B's replicas now
    time.sleep(2.2)
    offered = httpx.get(f"{gw}/health").json()["replicas"]
    assert offered and not {x["url"] for x in reps} & set(offered)
    assert httpx.get(f"{a}/healthz").json()["draining"] is True

    # undrain: A accepts replicas again (a bad layout is now judged on its merits: 400, not 409)
    assert httpx.post(f"{a}/v1/undrain", headers=H).json() == {"draining": False}
    r = httpx.post(f"{a}/v1/replicas", headers=H, json={"model": "builtin:tiny", "layout": "attn_tp=3"})
    assert r.status_code == 400, r.text
    listed = httpx.get(f"{a}/v1/replicas", headers=H).json()
    assert not listed["draining"] and not any(x["draining"] for x in listed["replicas"])
    time.sleep(2.2)
    offered = httpx.get(f"{gw}/health").json()["replicas"]
    assert {x["url"] for x in reps} <= set(offered)


def test_agent_migrate_route_end_to_end(two_agents):
    a, b, reps = two_agents["a"], two_agents["b"], two_agents["replicas"]
    src = reps[0]
    r = httpx.post(f"{a}/v1/replicas/{src['id']}/migrate", headers=H, json={"target": {"agent": b}})
    assert r.status_code == 400
    # {agent, layout}: B launches a new replica with another layout (src is idle: nothing to move yet)
    r = httpx.post(f"{a}/v1/replicas/{src['id']}/migrate", headers=H,
                   json={"target": {"agent": b, "layout": "attn_tp=2"}, "mode": "live"})
    assert r.status_code == 202, r.text
    op = wait_op(a, r.json()["operation_id"])
    assert op["state"] == "succeeded" and op["result"]["sessions"] == [], op
    new_id = op["result"]["replica"]
    new = httpx.get(f"{b}/v1/replicas/{new_id}", headers=H).json()
    assert new["status"] == "running" and new["layout"]["attn_tp"] == 2

    req = dict(prompt="migrate me through the agent", max_tokens=500, temperature=0.7, seed=5)
    got: dict = {}
    ev = threading.Event()
    t = threading.Thread(target=stream, args=(src["url"], req, got, 0, ev))
    t.start()
    assert ev.wait(60)
    # {agent, replica}, live: A's replica -> B's new tp=2 replica
    r = httpx.post(f"{a}/v1/replicas/{src['id']}/migrate", headers=H,
                   json={"target": {"agent": b, "replica": new_id}, "mode": "live"})
    assert r.status_code == 202, r.text
    op = wait_op(a, r.json()["operation_id"])
    assert op["state"] == "succeeded", op
    assert op["result"]["replica"] == new_id and len(op["result"]["sessions"]) == 1 and op["bytes_done"] > 0
    assert op["result"]["sessions_not_moved"] == []
    sid = op["result"]["sessions"][0]
    # the operation names the transfer as both replicas know it: released on the source, committed on the target
    t_src = httpx.get(f"{src['url']}/v1/sessions/transfers/{op['transfer']}", headers=H).json()
    t_dst = httpx.get(f"{new['url']}/v1/sessions/transfers/{op['transfer']}", headers=H).json()
    assert (t_src["outgoing"], t_dst["incoming"]) == ("released", "committed"), (t_src, t_dst)
    # and back to A's other replica, cold, through B's agent
    r = httpx.post(f"{b}/v1/replicas/{new_id}/migrate", headers=H,
                   json={"target": {"agent": a, "replica": reps[1]["id"]}, "mode": "cold"})
    assert r.status_code == 202, r.text
    op = wait_op(b, r.json()["operation_id"])
    assert op["state"] == "succeeded", op
    assert op["result"]["replica"] == reps[1]["id"] and op["result"]["sessions"] == [sid]
    t.join(120)
    # the client streamed from the source replica directly (no gateway to follow the moves): check the end state
    end = time.monotonic() + 120
    while True:
        s = httpx.get(f"{reps[1]['url']}/v1/sessions/{sid}", headers=H).json()
        if s["state"] == "finished" or time.monotonic() > end:
            break
        time.sleep(0.2)
    ref: dict = {}
    stream(reps[0]["url"], req, ref, 0)
    assert s["state"] == "finished" and s["token_ids"] == ref[0][1]
