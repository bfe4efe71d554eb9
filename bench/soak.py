"""The soak bench (`relayout bench soak`) and its clients: SSE streams that follow a session to
whichever replica ends up owning it, and the resource snapshots compared across migrations."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from relayout.migrate.procs import Proc, replica, usage


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


# ---- clients ------------------------------------------------------------------------------------
def reference(url: str, body: dict) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "return_token_ids": True}, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _owner(sid: str, candidates: list[str]) -> str | None:
    for url in candidates:
        try:
            r = httpx.get(f"{url}/v1/sessions/{sid}", timeout=3)
        except httpx.HTTPError:
            continue
        if r.status_code != 200:
            continue
        s = r.json()
        if s.get("state") == "migrated":
            if s.get("migrated_to"):
                return _owner(sid, [s["migrated_to"]] + [c for c in candidates if c != url]) or None
            continue
        return url
    return None


class Stream(threading.Thread):
    """One streamed completion that follows its session across replicas (like the gateway)."""

    def __init__(self, url: str, body: dict, follow: list[str] | None = None, deadline: float = 120):
        super().__init__(daemon=True)
        self.url, self.body, self.follow, self.deadline = url, body, follow or [], deadline
        self.tokens: list[int] = []
        self.sid: str | None = None
        self.error: Exception | None = None
        self.owners: list[str] = []
        self.started = threading.Event()
        self.done = False
        self.start()

    def _consume(self, resp: httpx.Response) -> None:
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                self.done = True
                return
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(obj["error"])
            self.sid = self.sid or obj["id"]
            self.tokens += obj["choices"][0].get("token_ids") or []
            if len(self.tokens) >= 2:
                self.started.set()

    def run(self) -> None:
        end = time.time() + self.deadline
        base = self.url
        try:
            with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                              json={**self.body, "stream": True, "return_token_ids": True}) as r:
                self.owners.append(base)
                self._consume(r)
        except (httpx.HTTPError, RuntimeError):
            pass
        while not self.done and time.time() < end and self.sid:
            owner = _owner(self.sid, [base, self.url] + self.follow)
            if owner is None:
                time.sleep(0.2)
                continue
            base = owner
            try:
                with httpx.stream("GET", f"{base}/v1/sessions/{self.sid}/stream", timeout=60,
                                  params={"from_token": len(self.tokens), "return_token_ids": "true"}) as r:
                    if r.status_code == 200:
                        if not self.owners or self.owners[-1] != base:
                            self.owners.append(base)
                        self._consume(r)
            except (httpx.HTTPError, RuntimeError):
                time.sleep(0.2)
        if not self.done:
            self.error = RuntimeError(f"stream {self.sid} did not finish ({len(self.tokens)} tokens)")
        self.started.set()


def replica_state(url: str) -> dict:
    return httpx.get(f"{url}/v1/replica", timeout=10).json()


def wait_for(pred, timeout: float = 20, every: float = 0.1):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        last = pred()
        if last:
            return last
        time.sleep(every)
    return last


# ---- the soak bench ------------------------------------------------------------------------------
def _snapshot(procs: dict[str, Proc]) -> dict:
    out = {}
    for name, p in procs.items():
        st = replica_state(p.url)
        out[name] = {**usage(p.pid), "kv_blocks_used": st["kv_blocks_used"], "sessions": len(st["sessions"])}
    return out


def _settle(procs: dict[str, Proc], timeout: float = 60) -> None:
    wait_for(lambda: all(not (s := replica_state(p.url))["sessions"] and s["kv_blocks_used"] == 0
                         for p in procs.values()), timeout, 0.2)


def run(count: int = 20, layouts: tuple[str, str] = ("attn_dp=1", "attn_tp=2"), sessions: int = 4,
        max_tokens: int = 48, model: str = "builtin:tiny", warmup: int = 2, rss_slack_mb: float = 64.0,
        log=print) -> dict:
    """Migrate `sessions` running sessions back and forth between two replicas of two layouts,
    `count` times, checking every output against an undisturbed run; then compare RSS, open file
    descriptors, processes and KV blocks of both replicas with their baseline (taken after
    `warmup` migrations, once allocators and caches have settled)."""
    from relayout.migrate.protocol.live import MigrationError, MigrationPlan, migrate_live

    if count < 1 or sessions < 1:
        raise ValueError("count and sessions must be >= 1")
    pool = ThreadPoolExecutor(2)
    futs = {"a": pool.submit(replica, layouts[0], None, model), "b": pool.submit(replica, layouts[1], None, model)}
    procs: dict[str, Proc] = {}
    try:
        for k, f in futs.items():
            procs[k] = f.result()
        urls = {k: p.url for k, p in procs.items()}
        bodies = [dict(prompt=f"soak {i}: " + "lorem ipsum " * (4 + 5 * i), max_tokens=max_tokens, ignore_eos=True,
                       **({"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0.0}))
                  for i in range(sessions)]
        refs = [reference(urls["a"], b) for b in bodies]
        _settle(procs)
        src, dst = "a", "b"
        stats = {"migrations": 0, "failed": 0, "sessions_moved": 0, "mismatches": 0, "stall_ms": []}
        baseline = None
        t0 = time.time()
        for i in range(warmup + count):
            if i == warmup:
                _settle(procs)
                baseline = _snapshot(procs)
                log(f"baseline: {json.dumps(baseline)}")
            ss = [Stream(urls[src], b, [urls[dst]]) for b in bodies]
            for s in ss:
                s.started.wait(60)
            try:
                res = migrate_live(urls[src], urls[dst], plan=MigrationPlan(small_bytes=0, max_rounds=2, timeout_s=60))
                if i >= warmup:
                    stats["migrations"] += 1
                    stats["sessions_moved"] += len(res.sessions)
                    stats["stall_ms"].append(res.stall_ms)
            except MigrationError as e:
                stats["failed"] += i >= warmup
                log(f"migration {i}: {e}")
            for k, s in enumerate(ss):
                s.join(120)
                if s.error is not None or s.tokens != refs[k]:
                    stats["mismatches"] += i >= warmup
            if i >= warmup:
                log(f"migration {i - warmup + 1}/{count} {src}->{dst}: moved {stats['sessions_moved']} sessions so far")
            src, dst = dst, src
        _settle(procs)
        time.sleep(0.5)
        final = _snapshot(procs)
        leaks = []
        for k in procs:
            b, f = baseline[k], final[k]
            if f["kv_blocks_used"] != 0 or f["sessions"]:
                leaks.append(f"{k}: {f['kv_blocks_used']} KV blocks / {f['sessions']} sessions left")
            if f["fds"] > b["fds"] + 2:
                leaks.append(f"{k}: file descriptors {b['fds']} -> {f['fds']}")
            if f["processes"] != b["processes"]:
                leaks.append(f"{k}: processes {b['processes']} -> {f['processes']}")
            if f["rss_mb"] > b["rss_mb"] + rss_slack_mb:
                leaks.append(f"{k}: RSS {b['rss_mb']} -> {f['rss_mb']} MiB")
        st = sorted(stats.pop("stall_ms")) or [0.0]
        return {"count": count, "layouts": list(layouts), "sessions": sessions, **stats,
                "stall_ms_p50": round(st[len(st) // 2], 2), "stall_ms_max": round(st[-1], 2),
                "seconds": round(time.time() - t0, 1), "baseline": baseline, "final": final,
                "leaks": leaks, "ok": not leaks and not stats["failed"] and not stats["mismatches"]}
    finally:
        for f in futs.values():
            try:
                f.result().stop()
            except Exception:  # noqa: BLE001
                pass
        pool.shutdown()
