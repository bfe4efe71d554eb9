"""Fleet re-layout controller (`relayout controller --agents`): a real agent with one skewed replica
(builtin:tiny-random); the controller re-lays it out through the agent's migrate route while streams run
through the gateway; the streams keep their tokens, the old replica is deleted after the grace, the new one has the
planned layout. Plus the CLI's choice between --replica and --agents."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from relayout.agent.commands.fleet import FleetController
from relayout.engine.model.layout import Layout
from relayout.migrate import procs
from relayout.migrate.placement.policy import PolicyConfig

from tests.helpers.agents import TOKEN, H, start_agent, stop
from tests.test_policy import MAX_TOKENS, PROMPTS, SKEWED_MODEL, _complete_all, _signal_group, _stream

EP2 = Layout.parse("attn_dp=2,moe_ep=2")  # identity placement: experts 0-3 on rank 0, the skew's side


def _streams(url: str, out: dict) -> tuple[list[threading.Thread], list[threading.Event]]:
    evs = [threading.Event() for _ in PROMPTS]
    ts = [threading.Thread(target=_stream, args=(url, p, MAX_TOKENS, out, i, evs[i])) for i, p in enumerate(PROMPTS)]
    [t.start() for t in ts]
    return ts, evs


@pytest.mark.timeout(170)
def test_fleet_controller_relayouts_through_the_agent(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYOUT_TOKEN", TOKEN)
    children = []
    try:
        pa, agent = start_agent(tmp_path / "a", tmp_path / "agent.log")
        children.append(pa)
        r = httpx.post(f"{agent}/v1/replicas", headers=H, json={"model": SKEWED_MODEL, "layout": EP2.to_dict()},
                       timeout=200)
        assert r.status_code == 201, r.text
        old = httpx.get(f"{agent}/v1/replicas/{r.json()['id']}", headers=H, timeout=30).json()  # with its pid
        gw = procs.gateway("--agent", agent, "--port", "0", log=tmp_path / "gateway.log", timeout=60)
        children.append(gw.p)

        def hold_old_while_launching(op: dict) -> None:
            # as test_policy's YieldingLauncher: on 2 shared cores the new replica's launch would compete with
            # the decoding one (on real hardware it runs on other devices); the old one waits (SIGSTOP) while
            # the agent launches, so the streams are still mid-generation when they move
            launching = op.get("state") in ("pending", "running") and op.get("phase") in ("queued", "resolving target")
            _signal_group(old["pid"], signal.SIGSTOP if launching else signal.SIGCONT)

        lines: list[str] = []
        cfg = PolicyConfig(consecutive=2, margin=1.5, cooldown_s=600, horizon_s=600, moe_fraction=0.5,
                           launch_s=15.0, stall_s=0.05, link_gbps=1.0)
        ctl = FleetController([agent], cfg, interval=1.0, stop_grace_s=3.0, log=lines.append,
                              on_operation=hold_old_while_launching)
        [s0] = ctl.run_once()
        assert s0.replica == old["id"] and s0.decision.reason.startswith("first observation"), s0.to_dict()
        before = _complete_all(old["url"], 48)  # skewed traffic on the identity placement
        ref: dict = {}
        ts, _ = _streams(gw.url, ref)  # the undisturbed run of the long streams
        [t.join(120) for t in ts]
        [s1] = ctl.run_once()
        assert s1.decision.action == "stay" and s1.decision.streak == 1, s1.decision.reason
        got: dict = {}
        ts, evs = _streams(gw.url, got)
        for e in evs:
            assert e.wait(60)
        [s2] = ctl.run_once()
        _signal_group(old["pid"], signal.SIGCONT)  # whatever happened
        [t.join(150) for t in ts]
        assert s2.decision.action == "relayout" and s2.acted and s2.error is None, s2.to_dict()
        line = json.loads(lines[-1])
        assert line["agent"] == agent and line["replica"] == old["id"] and line["acted"]
        moved = [s for m in s2.migrations for s in m.sessions]
        assert len(moved) >= 4, s2.to_dict()  # the streams were still generating when they moved
        for i in range(len(PROMPTS)):
            assert not isinstance(got[i], Exception), got[i]
            assert got[i] == ref[i], f"stream {i} changed by the move"
        new_id = s2.new_replica
        new = httpx.get(f"{agent}/v1/replicas/{new_id}", headers=H, timeout=30).json()
        assert new["status"] == "running" and new_id != old["id"]
        assert new["layout"]["placement"] == [list(r) for r in s2.decision.new_layout.placement]
        # within the grace the old replica still tells where a moved session went
        s = httpx.get(f"{old['url']}/v1/sessions/{moved[0]}", headers=H, timeout=30).json()
        assert s["state"] == "migrated" and s.get("migrated_to"), s
        ctl.wait_stopped(60)
        ids = [x["id"] for x in httpx.get(f"{agent}/v1/replicas", headers=H).json()["replicas"]]
        assert ids == [new_id]  # the old replica was deleted
        # the policy state went on with the new replica: its cooldown holds
        [s3] = ctl.run_once()
        assert s3.replica == new_id and s3.decision.action == "stay" and not s3.acted, s3.to_dict()
        assert _complete_all(new["url"], 48) == before  # same tokens on the planned layout
    finally:
        if "old" in locals():
            _signal_group(old["pid"], signal.SIGCONT)
        for p in reversed(children):
            stop(p)


def test_cli_controller_needs_replica_or_agents(monkeypatch):
    from relayout.agent.cli import app
    from typer.testing import CliRunner

    monkeypatch.delenv("RELAYOUT_AGENTS", raising=False)
    r = CliRunner().invoke(app, ["controller"])
    assert r.exit_code == 2 and "--replica" in r.output and "--agents" in r.output, r.output
    r = CliRunner().invoke(app, ["controller", "--replica", "http://127.0.0.1:9", "--agents", "http://127.0.0.1:9"])
    assert r.exit_code == 2 and "not both" in r.output, r.output
    monkeypatch.setenv("RELAYOUT_AGENTS", "http://127.0.0.1:9")  # the default --agents: checked like them
    r = CliRunner().invoke(app, ["controller", "--topology", "/nonexistent.yaml"])
    assert r.exit_code == 2 and "no such topology file" in r.output, r.output
