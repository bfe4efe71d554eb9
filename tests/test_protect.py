"""Protection: a replica's sessions replicated continuously to a standby replica, and promoted
there when the source dies — `kill -9`, or a partition (tests/proxy.py) then death — with every
complete output equal to an undisturbed run. Real replica processes over loopback; the test acts
as the client (the gateway's part): it streams from the source, and after the failure tells the
standby the tokens it got and reattaches there with `from_token`."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from relayout.engine.sampling import advance_rng, new_rng_state, sample
from relayout.engine.session import SamplingParams, SessionState
from relayout.migrate import procs

from tests.migration_helpers import port_of, reference, replica_state, wait_for
from tests.proxy import Proxy

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
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:] == "[DONE]":
                self.done = True
                return
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"])
            self.sid = self.sid or obj["id"]
            ids = obj["choices"][0].get("token_ids") or []
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
    for pid in procs.process_tree(p.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.kill()


def protect(source: str, standby_url: str, **kw) -> dict:
    r = httpx.post(f"{source}/v1/protection", json={"standby": standby_url, "every_tokens": 16, "lease_s": 1.0, **kw},
                   timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def started(clients: list[Client], source: str, rounds: int = 2, tokens: int = 24) -> dict:
    view = wait_for(lambda: (lambda v: v if v["rounds"] >= rounds and all(len(c.tokens) >= tokens for c in clients)
                             else None)(httpx.get(f"{source}/v1/protection", timeout=5).json()), 60, 0.02)
    assert view, [len(c.tokens) for c in clients]
    return view


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
        killed = time.monotonic()
        kill_all(src)
        assert wait_for(lambda: all(c.broke_at or c.done for c in clients), 30, 0.02)
        # as a gateway would: promote once with every token id forwarded to the clients (each client's
        # own promote below is then an idempotent check of its tokens against what the standby holds)
        told = {c.sid: c.tokens for c in clients if not c.done}
        r = httpx.post(f"{standby.url}/v1/standby/{p['protection']}/promote", json={"tokens": told}, timeout=30)
        assert r.status_code == 200, r.text
        for c in clients:
            c.failover.set()
        finish(clients, refs)
        moved = [c for c in clients if c.promote is not None]
        assert len(moved) >= 6, "most sessions were still generating at the kill"
        # some tails (tokens the clients got after the last sync) were recomputed by prefill, not regenerated
        assert sum(r.json()["tail_tokens"].values()) > 0, r.json()
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


def test_agent_protect_route_and_cli(tmp_path, standby: procs.Proc) -> None:
    """`relayout protect` through the agent: a standby launched with a layout; the replica's view
    shows the protection (each session's lag); `--stop` ends it. `serve --standby` protects from the start."""
    import subprocess
    import sys

    token = "protect-test-token"
    env = {**os.environ, "RELAYOUT_TOKEN": token}
    ag = procs.agent("--port", "0", "--data-dir", str(tmp_path), env={"RELAYOUT_TOKEN": token}, timeout=60)
    hdr = {"Authorization": f"Bearer {token}"}
    try:
        rid = httpx.post(f"{ag.url}/v1/replicas", json={"model": "builtin:tiny"}, headers=hdr, timeout=120).json()["id"]

        def cli(*args: str) -> dict:
            p = subprocess.run([sys.executable, "-m", procs.CLI_MODULE, "protect", rid, "--agent", ag.url, *args],
                               env=env, capture_output=True, text=True, timeout=180)
            assert p.returncode == 0, p.stderr
            return json.loads(p.stdout)

        started = cli("--layout", "attn_tp=1", "--every-tokens", "8")
        assert started["state"] == "active" and started["standby_replica"] != rid
        view = wait_for(lambda: (lambda d: d if d.get("protection", {}).get("rounds", 0) >= 1 else None)(
            httpx.get(f"{ag.url}/v1/replicas/{rid}", headers=hdr, timeout=10).json()), 20)
        assert view and view["protection"]["protection"] == started["protection"] and "sessions" in view["protection"]
        assert cli("--stop")["state"] == "stopped"
        assert "protection" not in httpx.get(f"{ag.url}/v1/replicas/{rid}", headers=hdr, timeout=10).json()
    finally:
        ag.stop()
    src = procs.launch("serve", "--model", "builtin:tiny", "--port", "0", "--standby", standby.url)
    try:
        v = wait_for(lambda: (lambda v: v if v["rounds"] >= 1 else None)(
            httpx.get(f"{src.url}/v1/protection", timeout=5).json()), 20)
        assert v and v["standby"] == standby.url and v["state"] == "active"
        httpx.delete(f"{src.url}/v1/protection", timeout=10)
    finally:
        src.stop()
