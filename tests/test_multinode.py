"""A replica whose ranks span hosts (#8): the driver runs some ranks and waits for the rest at its rank
endpoint; `relayout rank` starts them elsewhere under torchrun-style variables. Here the "hosts" are two
launcher processes on one machine (loopback). Also the driver<->rank channel itself: no pickle, hostile
frames refused."""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time

import httpx
import pytest
import torch
from relayout.engine.model.weights import resolve_model
from relayout.engine.ranks.rank_channel import ChannelClosed, ChannelError, RankChannel, free_port
from relayout.engine.ranks.rank_process import RankJoinError, rank_main
from relayout.engine.ranks.workers import RankFailure, RankPlacement
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.web import bearer_headers
from relayout.migrate import procs

from tests.test_layouts import run

TOKEN = "multinode-secret"


def rank_launcher(rank: int, world: int, endpoint_port: int, model: str = "builtin:tiny",
                  token: str | None = TOKEN) -> procs.Proc:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(endpoint_port), "RELAYOUT_TOKEN": token}
    return procs.rank("--model", model, "--threads", "1", env=env)


def driver_in_thread(layout: str, local: list[int], port: int, out: dict) -> threading.Thread:
    def build():
        try:
            out["engine"] = LLMEngine("builtin:tiny", layout, max_prefill_tokens=16,
                                      placement=RankPlacement(local_ranks=local, endpoint=f"127.0.0.1:{port}",
                                                              token=TOKEN, join_timeout_s=120))
        except Exception as e:  # noqa: BLE001 - asserted by the caller
            out["error"] = e

    t = threading.Thread(target=build, daemon=True)
    t.start()
    return t


# ---- the channel ------------------------------------------------------------------------------------
def test_channel_round_trips_tensors_without_pickle():
    a, b = socket.socketpair()
    tx, rx = RankChannel(a), RankChannel(b)
    ts = [torch.randn(3, 4), torch.randn(4, 6).t(), torch.randn(2, 3).to(torch.bfloat16),
          torch.arange(7), torch.empty(0, 5), torch.tensor([True, False])]
    meta = {"blocks": [1, 2, 3], "nested": {"x": [0.5]}}
    threading.Thread(target=tx.send, args=("step", meta, ts)).start()
    m = rx.recv(timeout=10)
    assert m.op == "step" and m.meta == meta
    assert len(m.tensors) == len(ts)
    for got, want in zip(m.tensors, ts, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    a.close()
    with pytest.raises(ChannelClosed):
        rx.recv(timeout=10)
    b.close()


def _raw_frame(magic: bytes, header: bytes, payload: bytes) -> bytes:
    return struct.pack(">4sQ", magic, 4 + len(header) + len(payload)) + struct.pack(">I", len(header)) + header + payload


@pytest.mark.parametrize("frame,why", [
    (_raw_frame(b"XXXX", b"{}", b""), "magic"),
    (_raw_frame(b"RLR1", b"[1]", b""), "JSON object"),
    (_raw_frame(b"RLR1", b'{"op":"x","tensors":[{"dtype":"float32","shape":[4]}]}', b"abc"), "more bytes"),
    (_raw_frame(b"RLR1", b'{"op":"x","tensors":[{"dtype":"object","shape":[1]}]}', b"abcdefgh"), "tensor description"),
    (_raw_frame(b"RLR1", b'{"op":"x","tensors":[]}', b"junk"), "not described"),
    (struct.pack(">4sQ", b"RLR1", 1 << 40) + struct.pack(">I", 2), "limit"),
])
def test_channel_refuses_malformed_frames(frame, why):
    a, b = socket.socketpair()
    rx = RankChannel(b)
    a.sendall(frame)
    with pytest.raises(ChannelError, match=why):
        rx.recv(timeout=10)
    a.close()
    b.close()


# ---- ranks on two launchers -------------------------------------------------------------------------
def test_ranks_on_two_launchers_match_world1():
    """Launcher 1 (this process) drives the replica and runs rank 0; launcher 2 (`relayout rank`,
    RANK=1) runs rank 1. Tokens and logits equal the single-device run; an impostor with the wrong
    token is turned away without disturbing the launch; a dead remote rank takes the replica down
    with its name; the remote launcher exits when the driver shuts down."""
    ref_toks, ref_logits, _ = run("builtin:tiny", None)
    port = free_port()
    out: dict = {}
    t = driver_in_thread("attn_tp=2", [0], port, out)
    with pytest.raises(RankJoinError, match="bad token"):
        rank_main(1, f"127.0.0.1:{port}", str(resolve_model("builtin:tiny")), token="wrong", world_size=2)
    rk = rank_launcher(1, 2, port)
    try:
        t.join(180)
        assert "error" not in out, out.get("error")
        eng = out["engine"]
        assert sorted(eng.executor.procs) == [0] and sorted(eng.executor.chans) == [0, 1]  # rank 1 is remote

        from tests.test_layouts import GREEDY, PROMPTS, SAMPLED

        logits: dict[str, list[torch.Tensor]] = {}
        eng.logits_hook = lambda sid, lg: logits.setdefault(sid, []).append(lg.clone())
        ss = [eng.add_session(p, GREEDY) for p in PROMPTS] + [eng.add_session(p, SAMPLED) for p in PROMPTS[:2]]
        while eng.has_work():
            eng.step()
        assert [s.output_token_ids for s in ss] == ref_toks
        for s, ref in zip(ss, ref_logits, strict=True):
            for x, y in zip(logits[s.session_id], ref, strict=True):
                assert (x - y).abs().max() / y.abs().max() < 1e-4
        assert sum(map(sum, eng.expert_stats()["expert_counts"])) > 0

        eng.shutdown()  # a clean stop: the remote rank is told to stop and exits 0
        assert rk.wait(60) == 0, rk.output()
    finally:
        if rk.poll() is None:
            rk.kill()

    # a remote rank killed mid-serving: the driver reports it by number, no hang, no orphan
    port = free_port()
    out = {}
    t = driver_in_thread("attn_tp=2", [0], port, out)
    rk = rank_launcher(1, 2, port)
    try:
        t.join(180)
        eng = out["engine"]
        from relayout.engine.runtime.session import SamplingParams

        eng.add_session([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        eng.step()
        rk.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1"):
            for _ in range(1000):
                eng.step()
        assert time.monotonic() - t0 < 60
        assert not any(p.is_alive() for p in eng.executor.procs.values())
    finally:
        if rk.poll() is None:
            rk.kill()


def test_remote_rank_with_another_model_stops_the_launch():
    port = free_port()
    out: dict = {}
    t = driver_in_thread("attn_tp=2", [0], port, out)
    rk = rank_launcher(1, 2, port, model="builtin:tiny-mixtral")
    try:
        t.join(180)
        assert isinstance(out.get("error"), RankFailure) and "different model" in str(out["error"]), out
        assert rk.wait(60) == 1
        assert "different model" in rk.output()
    finally:
        if rk.poll() is None:
            rk.kill()


def test_relayout_rank_needs_its_environment():
    env: dict[str, str | None] = {"RANK": None, "MASTER_ADDR": None, "MASTER_PORT": None}
    r = procs.rank(env=env)
    assert r.wait(60) == 2 and "RANK is not set" in r.output()
    r = procs.rank(env={**env, "RANK": "1"})
    assert r.wait(60) == 2 and "MASTER_ADDR" in r.output()


def test_serve_with_a_remote_rank_over_http():
    """`relayout serve --local-ranks 0 --rank-endpoint` + `relayout rank`: the OpenAI API answers with
    the world-1 tokens; once the remote rank is killed the replica answers 503 naming it."""
    port = free_port()
    env = {"RELAYOUT_TOKEN": TOKEN}
    rk = rank_launcher(1, 2, port)
    started: list[procs.Proc] = []
    try:
        drv = procs.replica("attn_tp=2", env, args=("--local-ranks", "0", "--rank-endpoint", f"127.0.0.1:{port}"))
        started.append(drv)
        one = procs.replica(None, env)
        started.append(one)
        req = {"model": "builtin:tiny", "prompt": "ranks on two hosts", "max_tokens": 12, "temperature": 0.7,
               "seed": 3, "return_token_ids": True}
        hdr = bearer_headers(TOKEN)
        got = httpx.post(f"{drv.url}/v1/completions", json=req, headers=hdr, timeout=60).json()
        ref = httpx.post(f"{one.url}/v1/completions", json=req, headers=hdr, timeout=60).json()
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        rk.send_signal(signal.SIGKILL)
        rk.wait(30)
        r = httpx.post(f"{drv.url}/v1/completions", json=req, headers=hdr, timeout=120)
        assert r.status_code == 503 and "rank 1" in r.text, r.text
    finally:
        if rk.poll() is None:
            rk.kill()
        for p in started:
            p.stop()
