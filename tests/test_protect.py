"""Protection: a replica's sessions replicated continuously to a standby replica, and promoted
there when the source dies — `kill -9`, or a partition (tests/helpers/proxy.py) then death — with every
complete output equal to an undisturbed run. Real replica processes over loopback; the test acts
as the client (the gateway's part): it streams from the source, and after the failure tells the
standby the tokens it got and reattaches there with `from_token`."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch
from relayout.engine.runtime.sampling import advance_rng, new_rng_state, sample
from relayout.engine.runtime.session import SamplingParams, SessionState
from relayout.migrate import procs

from tests.helpers.faults import kill_tree
from tests.helpers.migration import port_of, reference, replica_state, wait_for
from tests.helpers.proxy import Proxy
from tests.helpers.sse import DONE, sse_data, token_ids

PROMPTS = ["hello world " * k for k in (1, 3, 5, 8, 2, 13, 4, 21)]


def bodies() -> list[dict]:
    """8 sessions: greedy and seeded, different prompt and output lengths."""
    out = []
    for i, p in enumerate(PROMPTS):
        b = {"prompt": p, "max_tokens": 500 + 60 * i, "ignore_eos": True}
        b.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.9, "seed": 100 + i})
        out.append(b)
    return out


def test_advance_rng_matches_sampling() -> None:
    """The generator of a session that sampled n tokens equals one advanced past n (any logits)."""
    for p in (SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.3, top_k=5, seed=4),
              SamplingParams(temperature=0.7, top_p=0.5, seed=5)):
        a = SessionState("a", [1], p, rng_state=new_rng_state(p.seed))
        b = SessionState("b", [1], p, rng_state=new_rng_state(p.seed))
        for _ in range(7):
            sample(torch.randn(1000) * 3, a)
        advance_rng(b, 1000, 7)
        assert a.rng_state == b.rng_state
        assert sample(torch.randn(1000), a) is not None and a.rng_state != b.rng_state


class Client(threading.Thread):
    """One streamed completion from the source; when that stream breaks before the end, it tells
    the standby every token it got (promote) and reattaches there from the next one."""

    def __init__(self, source: str, body: dict):
        super().__init__(daemon=True)
        self.source, self.body = source, body
        self.standby: str | None = None
        self.pid: str | None = None
        self.tokens: list[int] = []
        self.sid: str | None = None
        self.done = False
        self.error: BaseException | None = None
        self.broke_at: float | None = None
        self.first_after: float | None = None  # time of the first token from the standby
        self.promote: dict | None = None
        self.failover = threading.Event()  # set by the test once the standby is known
        self.start()

    def _consume(self, resp: httpx.Response, standby: bool) -> None:
        for obj in sse_data(resp.iter_lines()):
            if obj == DONE:
                self.done = True
                return
            assert isinstance(obj, dict)
            if "error" in obj:
                raise RuntimeError(obj["error"])
            self.sid = self.sid or obj["id"]
            ids = token_ids(obj)
            if ids and standby and self.first_after is None:
                self.first_after = time.monotonic()
            self.tokens += ids

    def run(self) -> None:
        try:
            try:
                with httpx.stream("POST", f"{self.source}/v1/completions", timeout=60,
                                  json={**self.body, "stream": True, "return_token_ids": True}) as r:
                    self._consume(r, False)
            except httpx.HTTPError:
                pass
            if self.done:
                return
            self.broke_at = time.monotonic()
            assert self.failover.wait(60) and self.sid
            if self.pid is not None:  # else someone else promotes (the source's agent)
                r = httpx.post(f"{self.standby}/v1/standby/{self.pid}/promote", timeout=30,
                               json={"tokens": {self.sid: self.tokens}})
                assert r.status_code == 200, r.text
                self.promote = r.json()
            with httpx.stream("GET", f"{self.standby}/v1/sessions/{self.sid}/stream", timeout=60,
                              params={"from_token": len(self.tokens), "return_token_ids": "true"}) as r:
                assert r.status_code == 200
                self._consume(r, True)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


@pytest.fixture(scope="module")
def standby() -> Iterator[procs.Proc]:
    p = procs.replica()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def refs(standby: procs.Proc) -> list[list[int]]:
    return [reference(standby.url, b) for b in bodies()]


def kill_all(p: procs.Proc) -> None:
    """kill -9 the replica and every process under it."""
    kill_tree(p.pid)
    p.kill()


def protect(source: str, standby_url: str, headers: dict | None = None, **kw) -> dict:
    r = httpx.post(f"{source}/v1/protection", json={"standby": standby_url, "every_tokens": 16, "lease_s": 1.0, **kw},
                   timeout=10, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def started(clients: list, source: str, rounds: int = 2, tokens: int = 24, headers: dict | None = None) -> dict:
    """The protection's view once it sent `rounds` rounds and every client has `tokens` tokens."""
    view = wait_for(lambda: (lambda v: v if v["rounds"] >= rounds and all(len(c.tokens) >= tokens for c in clients)
                             else None)(httpx.get(f"{source}/v1/protection", timeout=5, headers=headers).json()),
                    60, 0.02)
    assert view, [len(c.tokens) for c in clients]
    return view


def between_rounds(source: str, standby: str, pid: str, got: Callable[[], int], headers: dict | None = None
                   ) -> None:
    """Wait until every session has a token or more the standby does not, and the clients got
    (`got`: generated tokens, all clients together) more than the standby holds: a kill right after
    a round was acknowledged, or while the clients' streams lag behind the last sync, would leave
    no tail for the promotion to recompute. And the next round is not about to land between this
    check and the caller's kill: every session is at least 6 tokens (a third of `every_tokens`, when
    more) short of `every_tokens` past the last sync, and that sync's round was cut less than `every_ms`
    - 60 ms ago (rounds also go every `every_ms`; a round in flight has not renewed the lease yet, so it
    counts as not cut)."""
    def ahead() -> bool:
        v = httpx.get(f"{source}/v1/protection", timeout=5, headers=headers).json()
        since_cut = v["lease_s"] - v["lease_left_s"]  # the lease runs from the last acknowledged round's cut
        short = max(6, v["every_tokens"] // 3)
        if (not v["sessions"] or since_cut > v["every_ms"] / 1000 - 0.06
                or any(not 1 <= s["lag_tokens"] <= v["every_tokens"] - short for s in v["sessions"])):
            return False
        held = httpx.get(f"{standby}/v1/standby/{pid}", timeout=5, headers=headers).json()
        return got() >= sum(s["output_tokens"] for s in held["sessions"]) + 4

    assert wait_for(ahead, 30, 0.005)


def finish(clients: list[Client], refs: list[list[int]]) -> None:
    for i, c in enumerate(clients):
        c.join(120)
        assert c.error is None, (i, repr(c.error))
        assert c.done and c.tokens == refs[i], f"session {i} changed: {len(c.tokens)} tokens vs {len(refs[i])}"


def test_protect_kill9_failover(standby: procs.Proc, refs: list[list[int]]) -> None:
    src = procs.replica()
    try:
        # protect, see the copies and the lag, unprotect: the standby frees everything
        p = protect(src.url, standby.url)
        one = Client(src.url, bodies()[0])
        v = started([one], src.url, tokens=8)
        assert [s["id"] for s in v["sessions"]] == [one.sid] and v["sessions"][0]["lag_tokens"] >= 0
        held = httpx.get(f"{standby.url}/v1/standby/{p['protection']}", timeout=5).json()
        assert held["state"] == "standby" and [s["id"] for s in held["sessions"]] == [one.sid]
        assert replica_state(standby.url)["kv_blocks_used"] > 0 and not replica_state(standby.url)["sessions"]
        # the copies live in the reserved KV blocks: each round's chunks are freed once imported
        assert wait_for(lambda: httpx.get(f"{standby.url}/v1/standby/{p['protection']}", timeout=5).json()[
            "staged_bytes"] == 0, 10, 0.01)
        assert httpx.delete(f"{src.url}/v1/protection", timeout=10).json()["standby"] == "dropped"
        assert replica_state(standby.url)["kv_blocks_used"] == 0
        one.join(60)
        assert one.done and one.tokens == refs[0]

        # protect again; 8 streams; kill -9 mid-generation
        p = protect(src.url, standby.url)
        clients = [Client(src.url, b) for b in bodies()]
        started(clients, src.url)
        for c in clients:
            c.standby, c.pid = standby.url, p["protection"]
        between_rounds(src.url, standby.url, p["protection"], lambda: sum(len(c.tokens) for c in clients))
        killed = time.monotonic()
        kill_all(src)
        assert wait_for(lambda: all(c.broke_at or c.done for c in clients), 30, 0.02)
        # as a gateway would: promote once with every token id forwarded to the clients (each client's
        # own promote below is then an idempotent check of its tokens against what the standby holds)
        told = {c.sid: c.tokens for c in clients if not c.done}
        # what the standby holds after the kill: a round may have landed between `between_rounds` and the
        # kill, leaving the clients no token beyond the last sync (then there is no tail to recompute)
        held = {s["id"]: s["output_tokens"] for s in httpx.get(
            f"{standby.url}/v1/standby/{p['protection']}", timeout=5).json()["sessions"]}
        ahead = {sid: len(t) - held[sid] for sid, t in told.items() if sid in held and len(t) > held[sid]}
        r = httpx.post(f"{standby.url}/v1/standby/{p['protection']}/promote", json={"tokens": told}, timeout=30)
        assert r.status_code == 200, r.text
        for c in clients:
            c.failover.set()
        finish(clients, refs)
        moved = [c for c in clients if c.promote is not None]
        assert len(moved) >= 6, "most sessions were still generating at the kill"
        # the tails (tokens the clients got after the last sync) were recomputed by prefill, not regenerated
        tails = r.json()["tail_tokens"]
        assert all(tails.get(sid, 0) > 0 for sid in ahead), (ahead, r.json())
        failover_ms = (min(c.first_after for c in moved if c.first_after) - killed) * 1000
        assert failover_ms < 15000
    finally:
        kill_all(src)


def test_protect_partition_then_death(standby: procs.Proc, refs: list[list[int]]) -> None:
    """A partition between source and standby: the source stops serving (fenced) before the standby
    promotes; when the link heals the source finds its lease gone and releases the sessions; then it
    dies. No session produces tokens in two places, and every output is the undisturbed one."""
    src = procs.replica()
    to_standby, to_source = Proxy(port_of(standby.url)), Proxy(port_of(src.url))
    try:
        p = protect(src.url, to_standby.url, source_url=to_source.url)
        pid = p["protection"]
        clients = [Client(src.url, b) for b in bodies()]
        started(clients, src.url)
        for c in clients:
            c.standby, c.pid = standby.url, pid
        to_standby.arm("partition")
        to_source.arm("partition")
        fenced = wait_for(lambda: (lambda v: v if v["state"] == "fenced" else None)(
            httpx.get(f"{src.url}/v1/protection", timeout=5).json()), 20, 0.05)
        assert fenced, "the source did not stop serving when its lease lapsed"
        def source_tokens() -> dict[str, int]:
            return {c.sid: len(httpx.get(f"{src.url}/v1/sessions/{c.sid}", timeout=5).json()["token_ids"])
                    for c in clients}

        frozen = source_tokens()
        promoted = wait_for(lambda: (lambda v: v if v["state"] == "promoted" else None)(
            httpx.get(f"{standby.url}/v1/standby/{pid}", timeout=5).json()), 20, 0.05)
        assert promoted, "the standby did not promote after the lease lapsed and the source went silent"
        time.sleep(0.3)
        # the fenced source produced nothing more while the standby took over
        assert source_tokens() == frozen
        assert fenced["fenced"], "the sessions the standby holds were fenced"
        states = {s["id"]: s["state"] for s in replica_state(src.url)["sessions"]}
        assert all(states.get(sid, "finished") == "paused" for sid in fenced["fenced"]), states
        # the link heals: the source finds its lease gone and gives the sessions up
        to_standby.heal()
        to_source.heal()
        lost = wait_for(lambda: (lambda v: v if v["state"] == "lost" else None)(
            httpx.get(f"{src.url}/v1/protection", timeout=5).json()), 20, 0.05)
        assert lost, "the source kept its sessions after the standby promoted them"
        for sid in fenced["fenced"]:
            s = httpx.get(f"{src.url}/v1/sessions/{sid}", timeout=5).json()
            assert s["state"] == "migrated" and s["migrated_to"] == to_standby.url
        kill_all(src)
        for c in clients:
            c.failover.set()
        finish(clients, refs)
    finally:
        to_standby.close()
        to_source.close()
        kill_all(src)


TOKEN = "protect-test-token"
HDR = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[procs.Proc]:
    """An agent whose replicas never promote on their own as standbys (only when asked: here, by the
    agent's health check), checking its replicas every 0.3 s. The last test kills it."""
    ag = procs.agent("--port", "0", "--data-dir", str(tmp_path_factory.mktemp("node")), timeout=60,
                     env={"RELAYOUT_TOKEN": TOKEN, "RELAYOUT_STANDBY_AUTOPROMOTE": "0", "RELAYOUT_HEALTH_S": "0.3"})
    try:
        yield ag
    finally:
        if ag.poll() is None:
            ag.stop()


def agent_replica(ag: procs.Proc, rid: str) -> dict:
    return httpx.get(f"{ag.url}/v1/replicas/{rid}", headers=HDR, timeout=10).json()


def test_agent_protect_route_and_cli(node: procs.Proc, standby: procs.Proc, refs: list[list[int]]) -> None:
    """`relayout protect` through the agent: a standby launched with a layout; the replica's view
    shows the protection (each session's lag); `--stop` ends it. The agent's health check notices the
    protected replica's death and has the standby promote. `serve --standby` protects from the start."""
    import subprocess
    import sys

    ag, env = node, {**os.environ, "RELAYOUT_TOKEN": TOKEN}
    rid = httpx.post(f"{ag.url}/v1/replicas", json={"model": "builtin:tiny"}, headers=HDR, timeout=120).json()["id"]

    def cli(*args: str) -> dict:
        p = subprocess.run([sys.executable, "-m", procs.CLI_MODULE, "protect", rid, "--agent", ag.url, *args],
                           env=env, capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    started_ = cli("--layout", "attn_tp=1", "--every-tokens", "8")
    assert started_["state"] == "active" and started_["standby_replica"] != rid
    view = wait_for(lambda: (lambda d: d if d.get("protection", {}).get("rounds", 0) >= 1 else None)(
        agent_replica(ag, rid)), 20)
    assert view and view["protection"]["protection"] == started_["protection"] and "sessions" in view["protection"]
    assert cli("--stop")["state"] == "stopped"
    assert "protection" not in agent_replica(ag, rid)

    # protected again; the replica (every process) is killed mid-generation; its standby does not promote
    # on its own here: the agent's health check of its replicas is what asks it to
    sb_rid = started_["standby_replica"]
    sb_url = agent_replica(ag, sb_rid)["url"].rstrip("/")
    src = agent_replica(ag, rid)
    p = httpx.post(f"{ag.url}/v1/replicas/{rid}/protect", headers=HDR, timeout=30,
                   json={"standby": {"agent": ag.url, "replica": sb_rid}, "every_tokens": 16, "lease_s": 1.0}).json()
    clients = [Client(src["url"], b) for b in bodies()[:3]]
    started(clients, src["url"], headers=HDR)
    assert wait_for(lambda: agent_replica(ag, rid).get("protected_to") == {"id": p["protection"], "standby": sb_url},
                    10, 0.05)
    kill_tree(src["pid"])
    fo = wait_for(lambda: agent_replica(ag, rid).get("failover"), 30, 0.05)
    assert fo and fo["state"] == "promoted" and not fo["already"], fo
    assert {c.sid for c in clients if not c.done} <= set(fo["sessions"]), fo
    assert agent_replica(ag, rid)["status"] == "dead"
    for c in clients:  # each reattaches on the standby (it regenerates what the clients got after the last sync)
        c.standby = sb_url
        c.failover.set()
    finish(clients, refs[:3])

    serve = procs.launch("serve", "--model", "builtin:tiny", "--port", "0", "--standby", standby.url)
    try:
        v = wait_for(lambda: (lambda v: v if v["rounds"] >= 1 else None)(
            httpx.get(f"{serve.url}/v1/protection", timeout=5).json()), 20)
        assert v and v["standby"] == standby.url and v["state"] == "active"
        httpx.delete(f"{serve.url}/v1/protection", timeout=10)
    finally:
        serve.stop()


def openai_stream(base: str, body: dict, out: dict, i: int) -> None:
    """One streamed completion with the official client; `out[i]`: its token ids so far, or its exception."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    extra = {k: body[k] for k in ("ignore_eos", "top_p", "seed") if k in body}
    out[i] = []
    try:
        for chunk in client.completions.create(model="builtin:tiny", prompt=body["prompt"], stream=True,
                                               max_tokens=body["max_tokens"], temperature=body["temperature"],
                                               extra_body={"return_token_ids": True, **extra}):
            out[i] += (chunk.choices[0].model_extra or {}).get("token_ids") or []
    except Exception as e:  # noqa: BLE001 - asserted by the test
        out[i] = e


def test_whole_agent_killed_through_the_gateway(node: procs.Proc, standby: procs.Proc,
                                                refs: list[list[int]]) -> None:
    """8 openai-client streams through the gateway on a protected replica of an agent; the agent and
    every process under it are killed mid-generation. The gateway holds the streams, asks the standby
    to promote with every token id it forwarded, and reattaches: every output is the undisturbed one,
    no client sees an error. Last: it kills the agent."""
    ag = node
    running = [r for r in httpx.get(f"{ag.url}/v1/replicas", headers=HDR, timeout=10).json()["replicas"]
               if r["status"] == "running"]
    src = running[0] if running else httpx.post(f"{ag.url}/v1/replicas", json={"model": "builtin:tiny"},
                                                headers=HDR, timeout=120).json()
    src_url = src["url"].rstrip("/")
    # rounds every 48 tokens, not 16: the kill must land 16 tokens (~30 ms here) before the next round; 6
    # tokens (~12 ms at 500 tokens/s a session) were less than the checks and the kill took, and a round
    # acknowledged in between left no tail to recompute
    pid = protect(src_url, standby.url, headers=HDR, every_tokens=48)["protection"]
    # the agent lists the replica's standby: how a gateway knows where its sessions may come back
    assert wait_for(lambda: agent_replica(ag, src["id"]).get("protected_to"), 10, 0.05)
    gw = procs.gateway("--agent", ag.url, "--port", "0", env={"RELAYOUT_TOKEN": TOKEN}, timeout=60)
    try:
        out: dict[int, list[int] | Exception] = {}
        threads = [threading.Thread(target=openai_stream, args=(gw.url, b, out, i), daemon=True)
                   for i, b in enumerate(bodies())]
        for t in threads:
            t.start()

        class Progress:  # what `started` reads of a client
            def __init__(self, i: int):
                self.i = i

            @property
            def tokens(self) -> list[int]:
                got = out.get(self.i, [])
                return got if isinstance(got, list) else list(range(10**6))

        started([Progress(i) for i in range(len(threads))], src_url, headers=HDR)
        progress = [Progress(i) for i in range(len(threads))]
        between_rounds(src_url, standby.url, pid, lambda: sum(len(c.tokens) for c in progress), HDR)
        kill_tree(ag.pid)
        ag.kill()
        for t in threads:
            t.join(120)
        for i, ref in enumerate(refs):
            assert not isinstance(out[i], Exception), (i, repr(out[i]))
            assert out[i] == ref, f"session {i} changed: {len(out[i])} tokens vs {len(ref)}"
        held = httpx.get(f"{standby.url}/v1/standby/{pid}", timeout=5).json()
        # promoted with the tails the gateway forwarded (recomputed by prefill, not regenerated)
        assert held["state"] == "promoted" and sum(held["tail_tokens"].values()) > 0, held
    finally:
        gw.stop()
