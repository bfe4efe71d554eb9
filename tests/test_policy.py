"""Re-layout policy (gain vs move cost, hysteresis, cooldown) and the controller end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

import httpx
import numpy as np
import pytest
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.layout import Layout
from relayout.engine.model.weights import resolve_model
from relayout.migrate import procs
from relayout.migrate.placement.controller import Controller, SubprocessLauncher
from relayout.migrate.placement.planner import Placement, balance
from relayout.migrate.placement.policy import Observation, PolicyConfig, RelayoutPolicy, current_placement
from relayout.migrate.procs import stop_process

from tests.helpers.sse import DONE, sse_data

E, L = 8, 2
EP2 = Layout.parse("attn_dp=2,moe_ep=2")


def _tiny_cfg() -> ModelConfig:
    return ModelConfig.from_dir(resolve_model("builtin:tiny"))


class Feed:
    """Cumulative counters of a replica whose traffic we choose window by window."""

    def __init__(self, policy: RelayoutPolicy, layout: Layout = EP2, sessions: int = 8, kv_tokens: int = 2000):
        self.policy, self.layout, self.sessions, self.kv_tokens = policy, layout, sessions, kv_tokens
        self.total = np.zeros((L, E))
        self.t = 0.0

    def window(self, shares, tokens: int = 1000, dt: float = 10.0):
        """One interval: `tokens` tokens (top-2: 2 routed pairs each) spread by `shares` over experts."""
        s = np.asarray(shares, dtype=float)
        self.total += np.outer(np.ones(L), s / s.sum() * tokens * 2)
        self.t += dt
        return self.policy.observe(Observation(self.total.tolist(), self.layout, self.sessions, self.kv_tokens, self.t))


UNIFORM = [1] * E
SKEWED = [6, 5, 5, 4, 1, 1, 1, 1]  # 80% of the load on ep rank 0 under the identity placement
TINY_SHIFT = [1.06, 1.04, 1.03, 1.02, 1, 1, 1, 1]  # ~51.5% on rank 0


def _policy(**kw) -> RelayoutPolicy:
    base = dict(consecutive=3, margin=1.5, cooldown_s=300, horizon_s=600, moe_fraction=0.5, launch_s=15,
                stall_s=0.05, kv_bytes_per_token=512, link_gbps=1.0)
    return RelayoutPolicy(PolicyConfig(**{**base, **kw}))


def test_skewed_shift_relayouts_only_after_k_observations():
    pol = _policy()
    f = Feed(pol)
    assert f.window(UNIFORM).reason.startswith("first observation")
    for _ in range(3):  # balanced traffic: nothing to gain
        d = f.window(UNIFORM)
        assert d.action == "stay" and d.streak == 0
    decisions = [f.window(SKEWED) for _ in range(6)]
    acts = [d.action for d in decisions]
    first = acts.index("relayout")
    # the EMA needs a window or two before the skew is worth the move, then K=3 favourable in a row
    assert first >= 2 and [d.streak for d in decisions[first - 2:first + 1]] == [1, 2, 3]
    d = decisions[first]
    assert d.expected_gain > d.move_cost * 1.5 and d.balance_new > d.balance_old
    lay = d.new_layout
    assert (lay.attn_dp, lay.attn_tp, lay.moe_ep, lay.moe_tp) == (2, 1, 2, 1)
    lay.validate(_tiny_cfg())  # a redundant placement the engine accepts
    assert all(len(row) == 10 for row in lay.placement)  # 2 redundant slots over 2 ranks
    # the planned placement balances the load the policy saw
    moe = list(range(L))
    p = Placement([list(r) for r in lay.placement], 2, [0, 0])
    assert balance(p, pol.load.load) > 0.95 > balance(current_placement(EP2, E, moe), pol.load.load) + 0.2
    # the decision starts the cooldown: the very next skewed window does not move again
    assert f.window(SKEWED).action == "stay"


def test_interrupted_streak_starts_over():
    pol = _policy(consecutive=2, alpha=1.0)  # alpha 1: each window is the load
    f = Feed(pol)
    f.window(UNIFORM)
    assert f.window(SKEWED).streak == 1
    assert f.window(UNIFORM).streak == 0  # back to balanced: the streak resets
    assert f.window(SKEWED).streak == 1
    assert f.window(SKEWED).action == "relayout"


def test_cost_above_gain_stays():
    # same skew, but the move costs more than the horizon's gain: a slow launch, a short horizon
    for kw in (dict(launch_s=400.0), dict(horizon_s=20.0), dict(link_gbps=1e-6)):
        pol = _policy(alpha=1.0, **kw)
        f = Feed(pol)
        f.window(UNIFORM)
        ds = [f.window(SKEWED) for _ in range(6)]
        assert all(d.action == "stay" for d in ds), kw
        assert "does not pay" in ds[-1].reason and ds[-1].expected_gain > 0
        assert ds[-1].move_cost * 1.5 >= ds[-1].expected_gain


def test_idle_replica_gains_nothing():
    pol = _policy(alpha=1.0, consecutive=1)
    f = Feed(pol)
    f.window(UNIFORM)
    f.window(SKEWED)  # one busy window (relayout-worthy on its own)
    pol.streak = 0
    pol.last_relayout = None
    ds = [f.window(SKEWED, tokens=0) for _ in range(12)]  # then nothing is generated
    assert ds[-1].action == "stay" and ds[-1].tokens_per_s < 1e-3


def test_tiny_shift_never_moves():
    pol = _policy(consecutive=1, alpha=1.0)
    f = Feed(pol)
    f.window(UNIFORM)
    ds = [f.window(TINY_SHIFT) for _ in range(10)]
    assert all(d.action == "stay" for d in ds)
    assert ds[-1].balance_new >= ds[-1].balance_old and ds[-1].expected_gain < ds[-1].move_cost * 1.5


def test_cooldown_after_relayout():
    pol = _policy(consecutive=1, alpha=1.0, cooldown_s=100)
    f = Feed(pol)
    f.window(UNIFORM)
    d = f.window(SKEWED)
    assert d.action == "relayout"
    pol.committed(EP2, now=f.t, launch_s=12.0, stall_ms=40.0, sessions=8)  # a move that kept the old layout
    assert pol.cfg.launch_s == 12.0 and pol.cfg.stall_s == pytest.approx(0.04)
    assert "first observation" in f.window(SKEWED, dt=10).reason  # new replica: counters re-primed
    ds = [f.window(SKEWED, dt=10) for _ in range(8)]  # t = 20..90 after the relayout
    assert all(d.action == "stay" and d.reason.startswith("cooldown") for d in ds)
    assert f.window(SKEWED, dt=15).action == "relayout"  # 105 s later: allowed again


def test_planned_layout_is_already_balanced():
    pol = _policy(consecutive=1, alpha=1.0)
    f = Feed(pol)
    f.window(UNIFORM)
    d = f.window(SKEWED)
    f2 = Feed(_policy(consecutive=1, alpha=1.0), layout=d.new_layout)
    f2.window(UNIFORM)
    ds = [f2.window(SKEWED) for _ in range(3)]
    assert all(x.action == "stay" and "too small" in x.reason for x in ds)


def test_counter_reset_and_dense_layers():
    pol = _policy(consecutive=1, alpha=1.0)
    lay = Layout.parse("attn_dp=2,moe_ep=2")
    obs = lambda counts, t: pol.observe(Observation(counts, lay, 2, 100, t))  # noqa: E731
    moe_row = [60, 50, 50, 40, 10, 10, 10, 10]
    assert obs([[], moe_row], 0).action == "stay"
    d = obs([[], [x * 50 for x in moe_row]], 10)  # layer 0 dense: identity row, layer 1 planned
    assert d.action == "relayout" and d.new_layout.placement[0] == tuple(range(E))
    assert len(d.new_layout.placement[1]) == 10
    assert "backwards" in obs([[], [1] * E], 20).reason


def test_observation_from_replica_json():
    rep = {"model": "builtin:tiny", "layout": EP2.to_dict(), "expert_counts": [[1] * E, [2] * E],
           "sessions": [{"id": "a", "state": "running", "num_tokens": 30}, {"id": "b", "state": "paused", "num_tokens": 12}]}
    o = Observation.from_replica(rep, t=5.0)
    assert (o.sessions, o.kv_tokens, o.layout.moe_ep, o.t) == (2, 42, 2, 5.0)
    assert RelayoutPolicy().observe(rep).action == "stay"


# ---- controller without replicas, and the CLI ---------------------------------------------------------------
class FakeReplica:
    def __init__(self):
        self.total = np.zeros((L, E))

    def __call__(self, url: str) -> dict:
        self.total += np.outer(np.ones(L), np.array(SKEWED) / sum(SKEWED) * 2000)
        return {"model": "builtin:tiny", "layout": EP2.to_dict(), "expert_counts": self.total.tolist(),
                "sessions": [{"id": "s1", "state": "running", "num_tokens": 50}]}


def test_controller_dry_run_and_failed_launch(monkeypatch):
    launched = []

    def launcher(model, layout):
        launched.append(layout)
        raise RuntimeError("no free devices")

    for dry in (True, False):
        lines: list[str] = []
        ctl = Controller("http://old", launcher, _policy(consecutive=2, alpha=1.0), dry_run=dry, log=lines.append)
        monkeypatch.setattr(ctl, "_get_replica", FakeReplica())
        steps = [ctl.run_once() for _ in range(3)]
        assert [s.decision.action for s in steps] == ["stay", "stay", "relayout"]
        assert not steps[-1].acted and ctl.replica_url == "http://old"
        assert json.loads(lines[-1])["decision"]["action"] == "relayout"
        if dry:
            assert not launched and steps[-1].error is None
        else:
            assert len(launched) == 1 and "launch failed: no free devices" in steps[-1].error
            assert ctl.run_once().decision.reason.startswith("cooldown")  # a failed move is not retried at once


def test_cli_plan_and_controller_help(tmp_path):
    from relayout.agent.cli import app
    from typer.testing import CliRunner

    topo = {"nodes": [{"name": "n1", "nvlink_domain_gbps": 450, "network_gbps": 25,
                       "devices": [{"id": f"n1/gpu{j}", "memory_gb": 80, "free": True} for j in range(4)]}]}
    inp = {"topology": topo, "load": [[9, 1, 1, 1, 1, 1, 1, 5]] * 2, "needs": {"devices": 4}}
    f = tmp_path / "in.json"
    f.write_text(json.dumps(inp))
    r = CliRunner().invoke(app, ["plan", str(f), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output.strip().splitlines()[-1])
    assert res["devices"] == [f"n1/gpu{j}" for j in range(4)] and res["balance"] >= res["baseline_balance"]
    r = CliRunner().invoke(app, ["plan", "-"], input=json.dumps(inp))
    assert r.exit_code == 0 and "relayout plan" in r.output and "phy2log" in r.output
    inp["needs"]["devices"] = 16
    r = CliRunner().invoke(app, ["plan", "-"], input=json.dumps(inp))
    assert r.exit_code == 1 and "not placeable" in r.output
    r = CliRunner().invoke(app, ["plan", "-"], input="{nope")
    assert r.exit_code == 2 and "not valid JSON" in r.output
    for cmd in (["controller", "--help"], ["bench", "placement", "--help"]):
        r = CliRunner().invoke(app, cmd)
        assert r.exit_code == 0 and "--json" in r.output or "--dry-run" in r.output


# ---- end to end --------------------------------------------------------------------------------------------
# Prompts whose greedy continuations route most tokens to experts 0-3 (ep rank 0 under the identity
# placement). Measured on builtin:tiny-random (the untrained tiny model: its routing is the skew these tests
# need; the trained builtin:tiny spreads these prompts evenly): each single-character prompt x16, 32 greedy
# tokens; these characters gave 70-99% of layer 0's and 50-90% of layer 1's routed pairs to experts 0-3.
SKEWED_MODEL = "builtin:tiny-random"
SKEW_CHARS = "{DEUaPS "
MAX_TOKENS = 160  # the long streams: still generating after the new replica's launch
PROMPTS = [c * 16 for c in SKEW_CHARS]


def _snap(url: str) -> tuple[np.ndarray, np.ndarray, dict]:
    r = httpx.get(f"{url}/v1/replica", timeout=30).json()
    return np.array(r["expert_counts"], float), np.array(r["a2a_bytes"], float), r


def _complete_all(url: str, max_tokens: int) -> list[list[int]]:
    out: dict[int, list[int]] = {}

    def one(i: int) -> None:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0,
                                                     "ignore_eos": True, "return_token_ids": True}, timeout=120)
        out[i] = r.json()["choices"][0]["token_ids"]

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    return [out[i] for i in range(len(PROMPTS))]


def _measure(url: str, layout: Layout, max_tokens: int) -> dict:
    """The short workload on `url`: balance of its placement on the measured per-expert counts
    (the engine's round-robin over replicas), and per-rank device load measured from the
    all-to-all bytes every rank received (each token copy is one row, self-sends included)."""
    c0, a0, _ = _snap(url)
    toks = _complete_all(url, max_tokens)
    c1, a1, _ = _snap(url)
    counts = (c1 - c0).tolist()
    recv = (a1 - a0).sum(axis=0)
    p = current_placement(layout, E, list(range(L)))
    return {"tokens": toks, "counts": counts, "balance": balance(p, counts), "device_recv": recv.tolist(),
            "device_balance": float(recv.mean() / recv.max())}


def _stream(url: str, prompt: str, max_tokens: int, out: dict, key: int, started: threading.Event) -> None:
    toks: list[int] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=180,
                          json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                "stream": True, "return_token_ids": True}) as r:
            for ev in sse_data(r.iter_lines()):
                if ev == DONE:
                    break
                assert isinstance(ev, dict) and "error" not in ev, ev
                toks += ev["choices"][0].get("token_ids") or []
                if len(toks) >= 3:
                    started.set()
        out[key] = toks
    except Exception as e:  # noqa: BLE001 - asserted by the test
        out[key] = e
        started.set()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(os.getpgid(pid), sig)
    except OSError:
        pass


class YieldingLauncher(SubprocessLauncher):
    """On real hardware a new replica starts on other devices and costs the running one nothing;
    on 2 shared CPU cores its launch would compete with the decoding replica for seconds, and
    on a quiet machine the streams could finish before the move. So the replicas already
    running are held (SIGSTOP: streams just wait) while the new one starts, and let go
    (SIGCONT) before the controller migrates: the streams are mid-generation either way."""

    def __call__(self, model: str, layout: Layout) -> str:
        olds = [p.pid for p in self.procs.values()]
        for pid in olds:
            _signal_group(pid, signal.SIGSTOP)
        try:
            return super().__call__(model, layout)
        finally:
            for pid in olds:
                _signal_group(pid, signal.SIGCONT)


def _launch_gateway(replica_url: str, log_dir) -> tuple[subprocess.Popen, str]:
    gw = procs.gateway("--replica", replica_url, "--port", "0", log=log_dir / "gateway.log", timeout=60)
    return gw.p, gw.url


@pytest.mark.timeout(170)
def test_controller_relayouts_skewed_replica_live(tmp_path):
    launcher = YieldingLauncher(log_dir=str(tmp_path))
    gw = None
    try:
        old_url = launcher(SKEWED_MODEL, EP2)  # identity placement: experts 0-3 on rank 0, 4-7 on rank 1
        gw, gw_url = _launch_gateway(old_url, tmp_path)
        pol = RelayoutPolicy(PolicyConfig(consecutive=2, margin=1.5, cooldown_s=600, horizon_s=600, moe_fraction=0.5,
                                          launch_s=15.0, stall_s=0.05, link_gbps=1.0))
        lines: list[str] = []
        ctl = Controller(old_url, launcher, pol, interval=1.0, stop_grace_s=2.0, log=lines.append)
        assert ctl.run_once().decision.reason.startswith("first observation")
        before = _measure(old_url, EP2, 48)  # the short skewed workload on the old layout
        # the undisturbed run of the long streams (through the gateway, nothing moves)
        ref: dict = {}
        evs = [threading.Event() for _ in PROMPTS]
        ts = [threading.Thread(target=_stream, args=(gw_url, p, MAX_TOKENS, ref, i, evs[i])) for i, p in enumerate(PROMPTS)]
        [t.start() for t in ts]
        [t.join(120) for t in ts]
        s1 = ctl.run_once()
        assert s1.decision.action == "stay" and s1.decision.streak == 1, s1.decision.reason
        # the same streams again; the controller decides, launches, live-migrates mid-stream
        got: dict = {}
        evs = [threading.Event() for _ in PROMPTS]
        ts = [threading.Thread(target=_stream, args=(gw_url, p, MAX_TOKENS, got, i, evs[i])) for i, p in enumerate(PROMPTS)]
        [t.start() for t in ts]
        for e in evs:
            assert e.wait(60)
        s2 = ctl.run_once()
        [t.join(150) for t in ts]
        assert s2.decision.action == "relayout" and s2.acted and s2.error is None, s2.to_dict()
        new_url, new_layout = s2.new_replica, s2.decision.new_layout
        assert ctl.replica_url == new_url != old_url
        moved = [s for m in s2.migrations for s in m.sessions]
        assert len(moved) >= 6, s2.to_dict()  # the streams were still generating when they moved
        for i in range(len(PROMPTS)):
            assert not isinstance(got[i], Exception), got[i]
            assert got[i] == ref[i], f"stream {i} changed by the move"
        assert _snap(new_url)[2]["layout"]["placement"] == [list(r) for r in new_layout.placement]
        ctl.wait_stopped(30)
        assert old_url not in launcher.procs  # the old replica was stopped
        # the same short workload on the new layout: same tokens, better balance
        after = _measure(new_url, new_layout, 48)
        assert after["tokens"] == before["tokens"]
        assert after["balance"] > before["balance"] + 0.1
        assert after["device_balance"] > before["device_balance"] + 0.1
        print(f"\nbalance before/after: model {before['balance']:.3f} -> {after['balance']:.3f}; measured per-device "
              f"{before['device_balance']:.3f} -> {after['device_balance']:.3f}; recv bytes {before['device_recv']} -> "
              f"{after['device_recv']}; decision: {s2.decision.reason}; moved {len(moved)} sessions, "
              f"stall {max(m.stall_ms for m in s2.migrations):.0f} ms, launch {s2.launch_s:.1f} s")
        # a tiny shift on the new layout (the same requests, 40 tokens instead of 48): a fresh policy
        # with no hysteresis (K=1, no cooldown) still keeps the replica
        watch = Controller(new_url, launcher, RelayoutPolicy(PolicyConfig(consecutive=1, cooldown_s=0, launch_s=15.0)))
        watch.run_once()
        _complete_all(new_url, 40)
        s3 = watch.run_once()
        assert s3.decision.action == "stay" and not s3.acted and watch.replica_url == new_url, s3.decision.reason
        assert s3.decision.expected_gain < s3.decision.move_cost * 1.5
        print(f"tiny shift on the new layout: {s3.decision.reason}")
    finally:
        if gw is not None:
            stop_process(gw)
        launcher.stop_all()
