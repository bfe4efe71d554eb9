"""Live migration across layouts while openai clients stream through the gateway."""

import os
import re
import signal
import subprocess
import threading

import httpx
import pytest
from openai import OpenAI
from relayout.engine.moves.snapshot import CHUNK_TOKENS
from relayout.migrate import procs
from relayout.migrate.protocol.live import (
    SLICE_GRAIN,
    MigrationError,
    MigrationPlan,
    migrate_live,
    round_slice_tokens,
)


def launch(*args: str) -> tuple[subprocess.Popen, str]:
    proc = procs.launch(*args)
    return proc.p, proc.url


def stop(p: subprocess.Popen) -> None:
    procs.Proc(p, "").stop()


REQUESTS = [
    dict(prompt=f"request {i}: " + "abc" * (i % 5), max_tokens=60 + 4 * i,
         **({"temperature": 0.9, "seed": 100 + i} if i % 2 else {"temperature": 0.0}))
    for i in range(16)
]


@pytest.fixture(scope="module")
def fleet():
    procs = []
    try:
        src, src_url = launch("serve", "--model", "builtin:tiny", "--layout", "attn_tp=2", "--port", "0")
        procs.append(src)
        dst, dst_url = launch("serve", "--model", "builtin:tiny", "--layout", "attn_dp=2,moe_ep=2", "--port", "0")
        procs.append(dst)
        gw, gw_url = launch("gateway", "--replica", src_url, "--port", "0")
        procs.append(gw)
        yield {"src": src_url, "dst": dst_url, "gw": gw_url, "procs": procs}
    finally:
        for p in procs:
            stop(p)


def stream_one(base: str, req: dict, out: dict, key: int, started: threading.Event | None = None):
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    toks, text = [], []
    try:
        for chunk in client.completions.create(model="builtin:tiny", stream=True,
                                               extra_body={"return_token_ids": True, "ignore_eos": True}, **req):
            c = chunk.choices[0]
            toks += getattr(c, "token_ids", None) or (c.model_extra or {}).get("token_ids") or []
            text.append(c.text)
            if started is not None and len(toks) >= 3:
                started.set()
        out[key] = (toks, "".join(text))
    except Exception as e:  # noqa: BLE001 - recorded, asserted below
        out[key] = e


def test_sixteen_streams_migrate_across_layouts(fleet):
    # undisturbed reference: the same requests straight to the target replica, before any migration
    ref: dict = {}
    ts = [threading.Thread(target=stream_one, args=(fleet["dst"], r, ref, i)) for i, r in enumerate(REQUESTS)]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    got: dict = {}
    events = [threading.Event() for _ in REQUESTS]
    ts = [threading.Thread(target=stream_one, args=(fleet["gw"], r, got, i, events[i])) for i, r in enumerate(REQUESTS)]
    [t.start() for t in ts]
    for e in events:
        assert e.wait(60)
    res = migrate_live(fleet["src"], fleet["dst"])
    [t.join(120) for t in ts]
    assert len(res.sessions) >= 8, res  # most sessions were still generating when they moved
    assert res.rounds[-1].final and len(res.rounds) >= 2
    # the pause after the final round, call by call, within the whole pause
    assert set(res.commit_timing) == {"target_check_ms", "release_ms", "commit_ms"}, res.commit_timing
    assert 0 < sum(res.commit_timing.values()) < res.stall_ms
    for i in range(len(REQUESTS)):
        assert not isinstance(got[i], Exception), got[i]
        assert got[i] == ref[i], f"request {i}"
    # the source holds nothing any more
    rep = httpx.get(f"{fleet['src']}/v1/replica").json()
    assert rep["sessions"] == [] and rep["kv_blocks_used"] == 0


def test_dead_target_leaves_sessions_on_source(fleet):
    dead, dead_url = launch("serve", "--model", "builtin:tiny", "--port", "0")
    r = httpx.post(f"{fleet['src']}/v1/completions",
                   json={"prompt": "keep going", "max_tokens": 120, "ignore_eos": True, "stream": True, "temperature": 0,
                         "return_token_ids": True}, timeout=60)
    sid = re.search(r'"id": ?"([^"]+)"', r.text).group(1)
    ref = httpx.get(f"{fleet['src']}/v1/sessions/{sid}").json()["token_ids"]
    assert len(ref) == 120
    got: dict = {}
    started = threading.Event()
    t = threading.Thread(target=stream_one, args=(fleet["src"], {"prompt": "keep going", "max_tokens": 120, "temperature": 0},
                                                  got, 0, started))
    t.start()
    assert started.wait(60)
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait(10)
    with pytest.raises(MigrationError, match="pre-copy"):
        migrate_live(fleet["src"], dead_url, plan=MigrationPlan(timeout_s=10))
    t.join(120)
    assert got[0][0] == ref  # finished on the source, unchanged


def test_target_short_of_blocks_refused_before_cutover(fleet):
    small, small_url = launch("serve", "--model", "builtin:tiny", "--port", "0", "--kv-cache-mb", "1")
    try:
        # two sessions of 1200+ tokens: together more than the 1 MiB target's 2047-token pool
        got: dict = {}
        started = [threading.Event(), threading.Event()]
        req = {"prompt": "x" * 1200, "max_tokens": 100, "temperature": 0}
        ts = [threading.Thread(target=stream_one, args=(fleet["src"], req, got, i, started[i])) for i in range(2)]
        [t.start() for t in ts]
        assert all(e.wait(60) for e in started)
        with pytest.raises(MigrationError, match="KV blocks"):
            migrate_live(fleet["src"], small_url)
        [t.join(120) for t in ts]
        for i in range(2):
            assert not isinstance(got[i], Exception) and len(got[i][0]) == 100
        assert httpx.get(f"{small_url}/v1/replica").json()["kv_blocks_used"] == 0
    finally:
        stop(small)


def test_precopy_rounds_are_sized_in_bytes_over_the_sessions():
    mib = 1 << 20
    assert round_slice_tokens(256 * mib, 64 * 1024, 1) == 4096  # builtin:bench, float32: 64 KiB a token
    assert round_slice_tokens(256 * mib, 64 * 1024, 3) == 1024  # 1365 tokens each, down to whole chunks
    assert round_slice_tokens(256 * mib, 64 * 1024, 5000) == CHUNK_TOKENS  # never below one chunk
    assert SLICE_GRAIN == CHUNK_TOKENS  # a round ends where a chunk does (live.py keeps torch out of its imports)
    assert round_slice_tokens(256 * mib, None, 2) == 1024  # a source that does not say its KV size
    assert round_slice_tokens(None, 64 * 1024, 2) is None  # no budget: the whole remainder per round
