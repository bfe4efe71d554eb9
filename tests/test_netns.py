"""Multi-host: two agents on two "hosts" made of network namespaces joined by a veth pair (10.200.0.1/30 and
10.200.0.2/30, nothing else reachable), a live migration from a replica on host A to one on host B across that
link, through agent A's migrate route. Needs root (CAP_NET_ADMIN) and `ip`; skips and says why otherwise.
All traffic stays inside the two namespaces created here."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from relayout.migrate.procs import stop_process

from tests.helpers.agents import TOKEN

ADDR_A, ADDR_B = "10.200.0.1", "10.200.0.2"
PORT = 7070

# runs inside namespace A: it can reach A (10.200.0.1) and, over the veth, B (10.200.0.2) — nothing else
DRIVER = r'''
import json, sys, threading, time
import httpx
a, b, token = sys.argv[1], sys.argv[2], sys.argv[3]
H = {"Authorization": f"Bearer {token}"}
def wait_op(agent, oid):
    end = time.monotonic() + 240
    while time.monotonic() < end:
        op = httpx.get(f"{agent}/v1/operations/{oid}", headers=H).json()
        if op["state"] in ("succeeded", "failed", "aborted"):
            return op
        time.sleep(0.2)
    raise SystemExit(f"operation {oid} did not finish")
def launch(agent, layout):
    r = httpx.post(f"{agent}/v1/replicas", headers=H, json={"model": "builtin:tiny", "layout": layout}, timeout=300)
    assert r.status_code == 201, r.text
    return r.json()
def finished(url, sid):
    end = time.monotonic() + 240
    while time.monotonic() < end:
        s = httpx.get(f"{url}/v1/sessions/{sid}", headers=H).json()
        if s["state"] == "finished":
            return s["token_ids"]
        time.sleep(0.2)
    raise SystemExit(f"session {sid} did not finish")
src, dst = launch(a, "attn_dp=1"), launch(b, "attn_dp=1,moe_ep=1")
req = {"model": "builtin:tiny", "prompt": "across hosts", "max_tokens": 700, "temperature": 0.8, "seed": 11,
       "ignore_eos": True, "return_token_ids": True}
box = {}
threading.Thread(target=lambda: box.update(r=httpx.post(f"{src['url']}/v1/completions", json=req, timeout=600)),
                 daemon=True).start()
end = time.monotonic() + 60
while True:
    ss = httpx.get(f"{a}/v1/replicas/{src['id']}", headers=H).json()["sessions"]
    if ss and ss[0]["num_tokens"] > 20:
        break
    assert time.monotonic() < end, ss
    time.sleep(0.05)
r = httpx.post(f"{a}/v1/replicas/{src['id']}/migrate", headers=H,
               json={"target": {"agent": b, "replica": dst["id"]}, "mode": "live"})
assert r.status_code == 202, r.text
op = wait_op(a, r.json()["operation_id"])
assert op["state"] == "succeeded", op
sid = op["result"]["sessions"][0]
moved = finished(dst["url"], sid)
ref = httpx.post(f"{src['url']}/v1/completions", json=req, timeout=600).json()["choices"][0]["token_ids"]
print("RESULT " + json.dumps({"src": src["url"], "dst": dst["url"], "bytes": op["bytes_done"],
                              "stall_ms": op["stall_ms"], "same": moved == ref, "n": len(moved)}), flush=True)
'''


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture()
def hosts():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (apt-get install -y iproute2)")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN); running unprivileged")
    tag = f"{os.getpid() % 100000}"
    ns = (f"rl-a-{tag}", f"rl-b-{tag}")
    veth = (f"rlva{tag}", f"rlvb{tag}")
    made: list[str] = []
    try:
        for n in ns:
            r = _ip("netns", "add", n, check=False)
            if r.returncode != 0:
                pytest.skip(f"cannot create a network namespace (no CAP_NET_ADMIN?): {r.stderr.strip()}")
            made.append(n)
        r = _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1], check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot create a veth pair: {r.stderr.strip()}")
        for n, v, addr in zip(ns, veth, (ADDR_A, ADDR_B), strict=True):
            _ip("link", "set", v, "netns", n)
            _ip("-n", n, "addr", "add", f"{addr}/30", "dev", v)
            _ip("-n", n, "link", "set", v, "up")
            _ip("-n", n, "link", "set", "lo", "up")
        yield {"ns": ns, "veth": veth}
    finally:
        for n in made:
            _ip("netns", "del", n, check=False)  # takes its veth end (and so the pair) with it


def _agent(ns: str, addr: str, data: Path, log: Path) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("relayout")
    out = open(log, "wb")
    p = subprocess.Popen(["ip", "netns", "exec", ns, str(exe), "agent", "--host", addr, "--port", str(PORT),
                          "--data-dir", str(data)], stdout=out, stderr=subprocess.STDOUT,
                         env=dict(os.environ, RELAYOUT_TOKEN=TOKEN, PYTHONUNBUFFERED="1"))
    out.close()
    end = time.monotonic() + 90
    while time.monotonic() < end:
        if re.search(rf"relayout agent on http://{re.escape(addr)}:{PORT}", log.read_text()):
            return p
        assert p.poll() is None, log.read_text()
        time.sleep(0.1)
    p.kill()
    raise AssertionError(log.read_text())


def _tx_bytes(ns: str, dev: str) -> int:
    r = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
                       capture_output=True, text=True, timeout=30)
    return int(r.stdout.strip() or 0)


def test_live_migration_between_two_hosts(hosts, tmp_path):
    (ns_a, ns_b), (veth_a, _) = hosts["ns"], hosts["veth"]
    procs = []
    try:
        procs.append(_agent(ns_a, ADDR_A, tmp_path / "a", tmp_path / "a.log"))
        procs.append(_agent(ns_b, ADDR_B, tmp_path / "b", tmp_path / "b.log"))
        tx0 = _tx_bytes(ns_a, veth_a)
        r = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", DRIVER, f"http://{ADDR_A}:{PORT}",
                            f"http://{ADDR_B}:{PORT}", TOKEN], capture_output=True, text=True, timeout=400,
                           cwd=Path(__file__).resolve().parents[1])
        m = re.search(r"^RESULT (.*)$", r.stdout, re.M)
        assert r.returncode == 0 and m, r.stdout[-3000:] + r.stderr[-3000:]
        res = json.loads(m.group(1))
        assert res["src"].startswith(f"http://{ADDR_A}:") and res["dst"].startswith(f"http://{ADDR_B}:")
        assert res["same"] and res["n"] == 700, res
        # the KV went over the link: host A's end of the veth sent at least the migrated bytes
        assert res["bytes"] > 0 and _tx_bytes(ns_a, veth_a) - tx0 >= res["bytes"], res
    finally:
        for p in procs:
            stop_process(p, 30)


# runs inside namespace A: one completion from the two-host replica, printed as token ids
ASK = r'''
import json, sys, httpx
url, token, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
req = {"model": "builtin:tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0.7, "seed": 3,
       "ignore_eos": True, "return_token_ids": True}
r = httpx.post(f"{url}/v1/completions", json=req, headers={"Authorization": f"Bearer {token}"}, timeout=300)
print("RESULT " + json.dumps({"status": r.status_code, "ids": r.json()["choices"][0]["token_ids"]}), flush=True)
'''


def test_replica_ranks_span_two_hosts(hosts, tmp_path):
    """One replica, attn_tp=2: the driver and rank 0 on host A, rank 1 (`relayout rank`) on host B. The
    attention all-reduce and the experts' all-to-all cross the veth; tokens equal a single-device run."""
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams

    (ns_a, ns_b), (veth_a, veth_b) = hosts["ns"], hosts["veth"]
    exe = str(Path(sys.executable).with_name("relayout"))
    env = dict(os.environ, RELAYOUT_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    prompt = [5, 17, 3, 99, 42, 7]
    procs = []
    try:
        log_a = open(tmp_path / "driver.log", "wb")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns_a, exe, "serve", "--layout", "attn_tp=2", "--host", ADDR_A, "--port", "8000",
             "--local-ranks", "0", "--rank-endpoint", f"{ADDR_A}:29500"],
            stdout=log_a, stderr=subprocess.STDOUT, env=dict(env, GLOO_SOCKET_IFNAME=veth_a)))
        log_b = open(tmp_path / "rank1.log", "wb")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns_b, exe, "rank", "--model", "builtin:tiny"], stdout=log_b,
            stderr=subprocess.STDOUT, env=dict(env, GLOO_SOCKET_IFNAME=veth_b, RANK="1", WORLD_SIZE="2",
                                               MASTER_ADDR=ADDR_A, MASTER_PORT="29500")))
        end = time.monotonic() + 180
        while "relayout serving" not in (tmp_path / "driver.log").read_text():
            assert procs[0].poll() is None and time.monotonic() < end, \
                (tmp_path / "driver.log").read_text() + (tmp_path / "rank1.log").read_text()
            time.sleep(0.2)
        tx0 = _tx_bytes(ns_b, veth_b)
        r = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", ASK, f"http://{ADDR_A}:8000", TOKEN,
                            json.dumps(prompt)], capture_output=True, text=True, timeout=300,
                           cwd=Path(__file__).resolve().parents[1])
        m = re.search(r"^RESULT (.*)$", r.stdout, re.M)
        assert r.returncode == 0 and m, r.stdout[-3000:] + r.stderr[-3000:]
        got = json.loads(m.group(1))
        assert got["status"] == 200
        # rank 1's share of the collectives went over the link
        assert _tx_bytes(ns_b, veth_b) - tx0 > 10_000
        eng = LLMEngine("builtin:tiny")
        s = eng.add_session(prompt, SamplingParams(max_tokens=40, temperature=0.7, seed=3, ignore_eos=True))
        while eng.has_work():
            eng.step()
        eng.shutdown()
        assert got["ids"] == s.output_token_ids
    finally:
        for p in procs:
            stop_process(p, 30)
