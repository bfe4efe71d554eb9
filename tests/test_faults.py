"""Fault matrix for live migration and checkpoints (README.md, Reliability). Every test asserts
where the sessions finished (source or target) with output identical to an undisturbed run,
that no KV blocks stay reserved, that no process is left behind, and that the error says
what happened. Faults are real: a loopback TCP proxy cuts / stalls / garbles the link, kill -9
hits replica processes at a phase reported by migrate_live's `on_phase` hook."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from relayout.migrate.procs import alive, children_of, launch, rank_processes
from relayout.migrate.protocol.live import MigrationError, MigrationPlan, migrate_live

from tests.helpers.faults import fault_kit
from tests.helpers.migration import (
    Moved,
    Stream,
    finish,
    finish_moved,
    idle,
    migrate_with_streams,
    no_transfers,
    port_of,
    record_transfer_ids,
    reference,
    replica_state,
    streams_on,
    transfers_on,
    unchanged,
    wait_for,
)
from tests.helpers.proxy import Proxy

TTL = 2.0  # RELAYOUT_TRANSFER_TTL_S of every replica here: how long a transfer may sit idle
PROMPTS = [f"fault {i}: " + "the quick brown fox " * (8 + 3 * i) for i in range(3)]
# long enough that the sessions are still running when a retried or delayed round completes on a
# loaded 2-core machine (a session that finishes first has nothing left to move, and the test sees none;
# 192 tokens stopped being enough once sampling stopped costing ~0.3 ms a token)
BODIES = [dict(prompt=p, max_tokens=384, ignore_eos=True, **({"temperature": 0.8, "seed": 7 + i} if i % 2 else
                                                            {"temperature": 0.0}))
          for i, p in enumerate(PROMPTS)]


class _Die(BaseException):
    """Raised from on_phase: the migrator vanishes there (no except-clause of it runs)."""


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    with fault_kit(tmp_path_factory.mktemp("faults"), TTL) as k:
        yield k


@pytest.fixture(scope="module")
def refs(kit):
    return [reference(kit["procs"]["b"].url, b) for b in BODIES]


def start_streams(src: str, follow: list[str], n: int = 3) -> list[Stream]:
    return streams_on(src, BODIES[:n], follow)


def migrate_streams(src: str, target: str, follow: list[str], **kw) -> Moved:
    return migrate_with_streams(src, target, follow, BODIES, **kw)


@pytest.fixture()
def ab(kit) -> tuple[str, str]:
    return kit["procs"]["a"].url, kit["procs"]["b"].url


@pytest.fixture()
def px(kit) -> Iterator[Proxy]:
    """A fault-injecting link to replica b's HTTP port: the tests through it push their rounds over
    HTTP (`transport="http"`); the same faults on the frame link: tests/test_frame_link.py."""
    p = Proxy(port_of(kit["procs"]["b"].url))
    try:
        yield p
    finally:
        p.close()


# ---- network faults ------------------------------------------------------------------------------
def test_network_cut_mid_round_resumes_from_acknowledged_chunks(ab, px, refs):
    """The connection to the target is cut inside the first pre-copy round, once: the round is
    retried, sending only the chunks the target does not acknowledge holding, and the
    migration completes with every output unchanged."""
    a, b = ab
    m = migrate_streams(a, px.url, [b], transport="http", arm=lambda: px.arm("cut", after=30_000),  # inside round 0's frames
                        max_rounds=2, timeout_s=30, source_for_target=a)
    assert px.fired.is_set() and m.result.retries >= 1
    finish_moved(m, refs, px.url, a)
    idle(a)
    idle(b)


def test_network_cut_that_persists_sessions_stay_on_source(ab, px, refs):
    """Every retry is cut too: the migration fails in pre-copy and the sessions stay home."""
    a, b = ab
    m = migrate_streams(a, px.url, [b], transport="http", arm=lambda: px.arm("partition", after=30_000), raises=MigrationError,
                        match="pre-copy", timeout_s=10)
    assert px.fired.is_set() and m.seconds < 30
    assert "the sessions continue on the source" in str(m.error)
    finish(m.streams, refs, a)
    idle(b, timeout=4 * TTL + 5)  # the migrator's abort cannot reach it: its lease frees it
    idle(a)


def test_partition_between_rounds_target_frees_reservations_alone(ab, px, refs):
    """The link goes down for good after round 0: the migrator's abort never reaches the target,
    which frees the reservations itself once the transfer has been idle for the TTL."""
    a, b = ab
    seen = {}

    def on_phase(p):
        if p == "pre-copy:1":
            seen["blocks"] = replica_state(b)["kv_blocks_used"]
            px.arm("partition", after=0)

    m = migrate_streams(a, px.url, [b], transport="http", raises=MigrationError, match="pre-copy", max_rounds=3, timeout_s=5,
                        on_phase=on_phase)
    assert seen["blocks"] > 0  # round 0 reserved blocks on the target
    finish(m.streams, refs, a)
    idle(b, timeout=4 * TTL + 5)


def test_slow_peer_migration_completes_on_target(ab, px, refs):
    a, b = ab
    m = migrate_streams(a, px.url, [b], transport="http", arm=lambda: px.arm("slow", after=0, delay=0.005),  # 5 ms per 16 KiB
                        max_rounds=2, timeout_s=30, source_for_target=a)
    finish_moved(m, refs, px.url, a)
    idle(a)
    idle(b)


def test_stalled_peer_times_out_sessions_stay_on_source(ab, px, refs):
    a, b = ab
    # retries=0: one timeout, not a retry loop
    m = migrate_streams(a, px.url, [b], transport="http", arm=lambda: px.arm("stall", after=20_000), raises=MigrationError,
                        match="pre-copy", timeout_s=2, retries=0)
    assert m.seconds < 20
    px.heal()
    finish(m.streams, refs, a)
    idle(b, timeout=4 * TTL + 5)


def test_garbled_frames_refused_by_target(ab, px, refs):
    a, b = ab
    # retries=0: when the garbling breaks the HTTP framing (a transport error) the round would
    # otherwise be resumed like a cut one, and succeed
    m = migrate_streams(a, px.url, [b], transport="http", arm=lambda: px.arm("garble", after=40_000), raises=MigrationError,
                        match="pre-copy", timeout_s=10, retries=0)
    # refused as corrupt frames (400), or as a broken HTTP body when the garbling hit its framing (the
    # target's HTTP server then drops the connection: closed, or reset while the body was still coming,
    # which the source's push sees as a ReadError on the reply)
    assert "continue on the source" in str(m.error)
    assert any(w in str(m.error) for w in ("HTTP 400", "peer closed", "Server disconnected", "protocol",
                                           "Connection reset", "ReadError")), m.error
    finish(m.streams, refs, a)
    idle(b)


def test_target_answers_garbage(ab, px, refs):
    a, b = ab
    # retries=0: a round whose answer is garbage is otherwise retried like a cut (see above)
    m = migrate_streams(a, px.url, [b], transport="http", arm=lambda: px.arm("garbage", after=10_000), raises=MigrationError,
                        timeout_s=10, retries=0)
    assert "continue on the source" in str(m.error)
    finish(m.streams, refs, a)
    idle(b)


# ---- processes killed ----------------------------------------------------------------------------
def kill_at(phase: str, kill: Callable[[], object]) -> Callable[[str], None]:
    """An on_phase hook that runs `kill` when the migration reaches `phase`."""
    return lambda p: kill() if p == phase else None


def test_kill9_target_during_precopy(kit, refs):
    a, t = kit["procs"]["a"].url, kit["procs"]["t_pre"]
    ranks = t.children()
    assert len(ranks) >= 2  # its two rank processes
    m = migrate_streams(a, t.url, [], raises=MigrationError, match="pre-copy", max_rounds=3, timeout_s=10,
                        on_phase=kill_at("pre-copy:1", t.kill9))
    finish(m.streams, refs, a)
    assert wait_for(lambda: not any(alive(r) for r in ranks), 20), "rank processes outlived their replica"
    idle(a)


def test_kill9_target_during_stop_and_copy(kit, refs):
    a, t = kit["procs"]["a"].url, kit["procs"]["t_stop"]
    m = migrate_streams(a, t.url, [], raises=MigrationError, match="stop-and-copy", max_rounds=2, timeout_s=10,
                        on_phase=kill_at("stop-and-copy", t.kill9))
    assert "continue on the source" in str(m.error)
    finish(m.streams, refs, a)  # they were paused by the final round and resumed by the abort
    idle(a)


def test_kill9_source_after_commit_sessions_finish_on_target(kit, refs):
    s, b = kit["procs"]["s_commit"], kit["procs"]["b"].url
    m = migrate_streams(s.url, b, [b], max_rounds=2, timeout_s=10, on_phase=kill_at("committed", s.kill9))
    assert s.p.poll() is not None
    finish_moved(m, refs, b, s.url)
    idle(b)


def test_rank_killed_on_target_mid_transfer(kit, refs):
    a, t = kit["procs"]["a"].url, kit["procs"]["t_rank"]
    ranks = rank_processes(t.pid)
    assert len(ranks) >= 2
    m = migrate_streams(a, t.url, [], raises=MigrationError, match="pre-copy", max_rounds=3, timeout_s=10,
                        on_phase=kill_at("pre-copy:1", lambda: os.kill(ranks[-1], signal.SIGKILL)))
    assert "HTTP 503" in str(m.error) and "rank" in str(m.error), m.error
    finish(m.streams, refs, a)
    # the target reports itself down, and its other rank went with it
    assert httpx.get(f"{t.url}/health", timeout=5).status_code == 503
    assert wait_for(lambda: not any(alive(r) for r in ranks), 20)
    idle(a)


# ---- the migrator itself dies (agent restarted mid-operation) -------------------------------------
def die() -> None:
    raise _Die


def test_migrator_dies_before_commit_source_resumes_after_lease(ab, refs):
    a, b = ab
    # at "prepared" the source paused them and the target holds them placed: then nobody decides
    m = migrate_streams(a, b, [b], raises=_Die, max_rounds=1, timeout_s=10, on_phase=kill_at("prepared", die))
    t = _transfers_on(b)[0]
    assert no_transfers(b, t)["incoming"] == "placed"
    finish(m.streams, refs, a)  # resumed on the source once its lease expired
    assert no_transfers(a, t)["outgoing"] == "expired"
    # a late commit is refused: the sessions stay where they are
    r = httpx.post(f"{a}/v1/sessions/release", json={"sessions": [m.streams[0].sid], "transfer": t})
    assert r.status_code == 409 and "expired" in r.json()["error"]["message"]
    # the target asked the source, learnt the transfer expired, and dropped its copy
    idle(b, timeout=4 * TTL + 5)
    assert no_transfers(b, t)["incoming"] == "expired"


def test_migrator_dies_after_commit_target_resumes_alone(ab, refs):
    a, b = ab
    m = migrate_streams(a, b, [b], raises=_Die, max_rounds=1, timeout_s=10, on_phase=kill_at("committed", die))
    finish(m.streams, refs, b)  # the target asked the source ("released") and resumed them
    idle(a)
    idle(b)


_seen_ids: list[str] = []  # transfer ids migrate_live made in this test (it returns none when it dies)


@pytest.fixture(autouse=True)
def _record_transfer_ids(monkeypatch):
    record_transfer_ids(monkeypatch, _seen_ids)


def _transfers_on(url: str) -> list[str]:
    return transfers_on(url, _seen_ids)


def test_agent_killed_mid_operation_and_restarted(kit, px, refs, tmp_path):
    """kill -9 the node agent while its migration is in pre-copy (over a slow link); after the
    restart the operation reads failed ("agent restarted"), the sessions finish on the source,
    the target frees its reservations, and the next migration is not blocked."""
    a, b = kit["procs"]["a"], kit["procs"]["b"]
    data = tmp_path / "agent"
    data.mkdir()
    reg = {"replicas": {
        "src": {"id": "src", "model": "builtin:tiny", "layout": None, "status": "running", "pid": a.pid, "url": a.url},
        "dst": {"id": "dst", "model": "builtin:tiny", "layout": None, "status": "running", "pid": b.pid, "url": px.url},
    }, "operations": {}}
    (data / "registry.json").write_text(json.dumps(reg))
    ag = launch("agent", "--port", "0", "--data-dir", str(data))
    try:
        ss = start_streams(a.url, [b.url])
        px.arm("slow", after=0, delay=0.25)
        r = httpx.post(f"{ag.url}/v1/replicas/src/migrate",  # over HTTP: the proxy slows the target's HTTP port
                       json={"target": {"agent": ag.url, "replica": "dst"}, "mode": "live", "transport": "http"})
        assert r.status_code == 202, r.text
        oid = r.json()["operation_id"]
        assert wait_for(lambda: httpx.get(f"{ag.url}/v1/operations/{oid}").json()["phase"] in
                        ("pre-copy", "stop-and-copy"), 30)
        ag.kill9()
        ag = launch("agent", "--port", "0", "--data-dir", str(data))
        op = httpx.get(f"{ag.url}/v1/operations/{oid}").json()
        assert op["state"] == "failed" and op["error"] == "agent restarted"
        px.heal()
        finish(ss, refs, a.url)
        idle(b.url, timeout=4 * TTL + 5)
        # the source's lease on the dead migration has lapsed: a new one may start
        time.sleep(TTL + 1)
        ss = start_streams(a.url, [b.url])
        r = httpx.post(f"{ag.url}/v1/replicas/src/migrate",
                       json={"target": {"agent": ag.url, "replica": "dst"}, "mode": "live"})
        op = wait_for(lambda: (lambda o: o if o["state"] in ("succeeded", "failed") else None)(
            httpx.get(f"{ag.url}/v1/operations/{r.json()['operation_id']}").json()), 60)
        assert op["state"] == "succeeded", op
        unchanged(ss, refs)
        idle(b.url)
    finally:
        ag.kill9()  # SIGKILL: a graceful agent stop would also stop the replicas in its registry


# ---- concurrency and room -------------------------------------------------------------------------
def test_second_migration_of_same_replica_refused(ab, px, refs):
    a, b = ab
    first: dict = {}
    ss = start_streams(a, [b])
    px.arm("slow", after=0, delay=0.01)
    # over HTTP: the proxy slows the target's HTTP port (the frame link would bypass it)
    t = threading.Thread(target=lambda: first.update(res=migrate_live(a, px.url, plan=MigrationPlan(
        small_bytes=0, max_rounds=1, timeout_s=30, source_for_target=a, transport="http"))))
    t.start()
    assert wait_for(lambda: _transfers_on(a), 10)
    with pytest.raises(MigrationError, match="409.*one outgoing migration at a time"):
        migrate_live(a, b, plan=MigrationPlan(timeout_s=10))
    t.join(60)
    assert first["res"].phase == "done"  # the first one was not disturbed
    unchanged(ss, refs)
    idle(a)
    idle(b)


def test_checkpoint_with_stop_refused_during_migration(kit):
    a = kit["procs"]["a"].url
    s = Stream(a, BODIES[0])
    assert s.started.wait(60)
    r = httpx.post(f"{a}/v1/sessions/export", json={"transfer": "busy-1", "sessions": None})
    assert r.status_code == 200
    try:
        c = httpx.post(f"{a}/v1/sessions/checkpoint", json={"stop": True})
        assert c.status_code == 409 and "busy-1" in c.json()["error"]["message"]
    finally:
        httpx.delete(f"{a}/v1/sessions/transfers/busy-1")
    s.join(60)
    assert s.error is None


# ---- storage faults -------------------------------------------------------------------------------
def test_s3_server_killed_mid_upload(kit, refs):
    import boto3

    a = kit["procs"]["a"].url
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{kit['moto_port']}", aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")
    assert wait_for(lambda: _try(lambda: s3.create_bucket(Bucket="faults")), 20)
    moto = kit["moto"]
    ss = start_streams(a, [])
    kit["s3proxy"].arm("cut", after=60_000, on_fire=moto.kill)
    t0 = time.time()
    r = httpx.post(f"{a}/v1/sessions/checkpoint", json={"destination": "s3://faults/ckpt", "stop": True}, timeout=120)
    assert kit["s3proxy"].fired.is_set()
    assert r.status_code in (400, 502), r.text
    msg = r.json()["error"]["message"]
    assert "S3" in msg or "s3" in msg or "Endpoint" in msg or "Connection" in msg, msg
    assert "Traceback" not in r.text and time.time() - t0 < 90
    finish(ss, refs, a)  # paused for the cut, resumed when nothing was committed
    idle(a)


def _try(fn):
    try:
        fn()
        return True
    except Exception:  # noqa: BLE001
        return False


def test_local_disk_full(kit, refs):
    a = kit["procs"]["a"].url
    full = kit["full"]
    if full is None:
        pytest.skip("cannot mount a tmpfs here (not root); test_disk_full_store_enospc covers the store")
    ss = start_streams(a, [])
    r = httpx.post(f"{a}/v1/sessions/checkpoint", json={"destination": full.as_uri(), "stop": True}, timeout=60)
    assert r.status_code in (400, 502), r.text
    assert "No space left on device" in r.json()["error"]["message"]
    assert not list((full / "manifests").glob("*")) if (full / "manifests").exists() else True
    assert not list((full / "tmp").glob("*")) if (full / "tmp").exists() else True  # no torn temp files
    finish(ss, refs, a)
    idle(a)


def test_disk_full_store_enospc():
    """In-process: a store whose writes fail with ENOSPC; nothing becomes visible."""
    import errno

    import torch
    from relayout.storage.checkpoint import CheckpointWriter
    from relayout.storage.format.chunks import pack_kv  # noqa: F401 - imported for the writer
    from relayout.storage.format.manifest import KVGeometry, ModelRef
    from relayout.storage.stores import MemoryStore

    class Full(MemoryStore):
        def _put_chunk_new(self, h, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    st = Full()
    with pytest.raises(OSError, match="No space"):
        with CheckpointWriter(st, "c-full") as w:
            w.put_kv("s1", 0, 0, 2, 0, 16, torch.zeros(2, 2, 16, 16))
            w.add_session("s1", {}, 16)
            w.commit(ModelRef(name="m", fingerprint="f" * 16, config={}), {}, KVGeometry(
                num_layers=1, num_kv_heads=2, head_dim=16, dtype="float32"), {})
    assert st.list_checkpoints() == []


def test_parallel_map_failure_waits_for_running_calls():
    """A failed chunk write must not answer while sibling writes still run: they would leave
    temp files behind after the caller cleaned up (a clean-clone CI saw one on a full tmpfs)."""

    import torch
    from relayout.storage.format.chunks import parallel_map

    finished: list[int] = []
    started = threading.Barrier(2, timeout=10)

    def work(i: int) -> int:
        if i == 0:
            started.wait()
            raise OSError(28, "No space left on device")
        started.wait()
        time.sleep(0.3)
        finished.append(i)
        return i

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(OSError, match="No space"):
            parallel_map(work, [0, 1])
        assert finished == [1]  # the sibling ended before the error reached the caller
    finally:
        torch.set_num_threads(old)


def test_no_processes_leaked(kit):
    """Runs last in this module: every killed replica left no rank process behind."""
    for name, p in kit["procs"].items():
        if p.p.poll() is not None:
            assert not children_of(p.pid), name
