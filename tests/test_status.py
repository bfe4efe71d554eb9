"""`relayout status` as an operator runs it: two agents, a replica with live sessions on the first,
a drain to the second; status shows the drain running with its progress, then where things went."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from relayout.engine.ranks.rank_channel import free_port
from relayout.migrate import procs

from tests.helpers.agents import TOKEN, H, lower_priority, start_agent, stop, wait_op
from tests.helpers.migration import Stream

BODY = {"prompt": "status", "max_tokens": 3500, "temperature": 0, "ignore_eos": True}


def status(*agents: str, as_json: bool = True) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", procs.CLI_MODULE, "status", *(x for a in agents for x in ("--agent", a))]
    return subprocess.run([*args, *(["--json"] if as_json else [])], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RELAYOUT_TOKEN": TOKEN, "COLUMNS": "240"})


@pytest.fixture()
def two_agents(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYOUT_TOKEN", TOKEN)
    pa, a = start_agent(tmp_path / "a", tmp_path / "a.log")
    try:
        pb, b = start_agent(tmp_path / "b", tmp_path / "b.log")
    except BaseException:
        stop(pa)
        raise
    try:
        yield a, b
    finally:
        stop(pa)
        stop(pb)


def test_status_follows_a_drain(two_agents):
    a, b = two_agents
    r = httpx.post(f"{a}/v1/replicas", headers=H, json={"model": "builtin:tiny", "layout": "attn_dp=1"}, timeout=200)
    assert r.status_code == 201, r.text
    rep = r.json()
    lower_priority(httpx.get(f"{a}/v1/replicas/{rep['id']}", headers=H).json()["pid"], 10)  # B's launch goes first
    streams = [Stream(rep["url"], {**BODY, "prompt": f"status {i}"}, follow=[]) for i in range(2)]
    for s in streams:
        assert s.started.wait(60)

    before = json.loads(status(a, b).stdout)
    na, nb = before["nodes"]
    assert na["reachable"] and not na["draining"] and nb["reachable"] and nb["replicas"] == []
    (shown,) = na["replicas"]
    assert shown["id"] == rep["id"] and shown["sessions"] == 2 and shown["kv_blocks_used"] > 0
    assert shown["layout"]["attn_dp"] == 1 and 0 < shown["expert_balance"] <= 1

    oid = httpx.post(f"{a}/v1/drain", headers=H, json={"target_agent": b}, timeout=60).json()["operation_id"]
    seen = None
    end = time.monotonic() + 120
    while time.monotonic() < end:  # while B launches the target, the drain is running with its sessions listed
        st = json.loads(status(a, b).stdout)
        ops = [o for o in st["nodes"][0]["operations"] if o["id"] == oid]
        if ops and ops[0]["state"] == "running" and ops[0]["total"] == 2:
            seen = st
            break
        time.sleep(0.3)
    assert seen is not None, "status never showed the drain running"
    assert seen["nodes"][0]["draining"] is True
    (op,) = seen["nodes"][0]["operations"]
    assert op["kind"] == "drain" and 0 <= op["done"] <= 2
    assert [e["replica"] for e in op["replicas"]] == [rep["id"]] and op["replicas"][0]["sessions_at_start"] == 2

    table = status(a, b, as_json=False)
    assert table.returncode == 0, table.stderr
    for text in ("relayout status", "draining", rep["id"][:6]):  # short ids at the default 80 columns
        assert text in table.stdout, table.stdout
    # the running drain's row and its progress bar ("━"), as the table renders the snapshot that showed
    # it running (the CLI's own run, a second later, may find a quick drain already done)
    from relayout.agent.commands.status import render
    from rich.console import Console

    con = Console(width=240, record=True, file=io.StringIO())
    con.print(render(seen, width=240, wide=True))
    shown_table = con.export_text()
    assert f"drain {oid}" in shown_table, shown_table
    assert "━" in shown_table or "──" in shown_table, shown_table  # its bar: done (━) and still to go (─)

    done = wait_op(a, oid, timeout=240)
    assert done["state"] == "succeeded", done
    after = json.loads(status(a, b).stdout)
    assert after["nodes"][0]["operations"] == [] and after["nodes"][0]["draining"] is True
    (moved,) = after["nodes"][1]["replicas"]
    assert moved["id"] == done["result"]["replicas"][0]["target_replica"]
    for s in streams:
        s.join(240)


def test_status_names_an_unreachable_agent():
    dead = f"http://127.0.0.1:{free_port()}"
    got = status(dead)
    assert got.returncode == 1
    (node,) = json.loads(got.stdout)["nodes"]
    assert node["agent"] == dead and not node["reachable"] and "ConnectError" in node["error"]


def _three_replicas_and_a_migration() -> dict:
    lay = {"attn_dp": 1, "attn_tp": 2, "moe_ep": 1, "moe_tp": 2, "placement": None, "overlap": False}
    reps = [{"id": rid, "status": "running", "model": "builtin:tiny", "url": f"http://127.0.0.1:4{i}123",
             "layout": {**lay, "attn_dp": i + 1}, "sessions": 3 * i, "kv_blocks_used": 120 * i,
             "kv_blocks_total": 4096, "expert_balance": 0.93, "error": None}
            for i, rid in enumerate(("r-3cce1a2b", "r-9f00aa11", "r-3cdd0c0d"))]
    op = {"id": "op-5e6f7a8b9c0d", "kind": "migrate", "replica": "r-3cce1a2b", "state": "running",
          "phase": "pre-copy:2", "bytes_done": 3 << 20, "bytes_total": 8 << 20, "done": 3 << 20, "total": 8 << 20}
    return {"nodes": [{"agent": "http://10.0.0.12:7070", "reachable": True, "draining": False,
                       "replicas": reps, "operations": [op]}]}


@pytest.mark.parametrize("width", [80, 160])
def test_status_fits_its_terminal_without_cutting_a_cell(width):
    """A node with three replicas and one running migration at 80 and 160 columns: the node as a heading,
    short ids (two that share `r-3c` stay apart), compact layouts, no cell cut with an ellipsis."""
    from relayout.agent.commands.status import render
    from rich.console import Console

    con = Console(width=width, record=True, file=io.StringIO())
    con.print(render(_three_replicas_and_a_migration(), width=width))
    text = con.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width, text
    for shown in ("http://10.0.0.12:7070", "serving", "r-3cce", "r-9f00", "r-3cdd", "dp1 tp2 ep1 mtp2",
                  "dp3 tp2 ep1 mtp2", "migrate op-5e6f", "pre-copy:2", "240/4096", "0.93"):
        assert shown in text, (shown, text)
    assert "r-3cce1a2b" not in text  # short ids unless --wide


def test_status_wide_shows_everything():
    from relayout.agent.commands.status import render
    from rich.console import Console

    con = Console(width=200, record=True, file=io.StringIO())
    con.print(render(_three_replicas_and_a_migration(), width=200, wide=True))
    text = con.export_text()
    for shown in ("r-3cce1a2b", "op-5e6f7a8b9c0d", "attn_dp=2,attn_tp=2,moe_ep=1,moe_tp=2", "http://127.0.0.1:41123"):
        assert shown in text, (shown, text)
