"""Fault-injection kit for the reliability tests and the soak bench: replica processes, a
loopback TCP proxy that cuts / slows / stalls / garbles a link after N bytes, and SSE
clients that follow a session to whichever replica ends up owning it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

URL_RE = re.compile(r"(http://[\d.]+:\d+)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- processes ---------------------------------------------------------------------------------
class Proc:
    def __init__(self, p: subprocess.Popen, url: str):
        self.p, self.url, self.pid = p, url, p.pid

    def children(self) -> list[int]:
        return children_of(self.pid)

    def kill9(self) -> None:
        if self.p.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.p.wait(10)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


def children_of(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def rank_processes(pid: int) -> list[int]:
    """The rank processes (multiprocessing spawn children) of a replica's driver process."""
    out = []
    for c in children_of(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(c)
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def launch(*args: str, env: dict | None = None, timeout: float = 180) -> Proc:
    p = subprocess.Popen([sys.executable, "-m", "agent.cli", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    t0 = time.time()
    while time.time() - t0 < timeout:
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            raise RuntimeError(f"{args} exited with {p.returncode}")
        m = URL_RE.search(line)
        if m and ("serving" in line or "agent" in line or "gateway" in line):
            threading.Thread(target=p.stdout.read, daemon=True).start()  # keep the pipe drained
            return Proc(p, m.group(1))
    p.kill()
    raise RuntimeError(f"{args} did not start")


def replica(layout: str | None = None, env: dict | None = None, model: str = "builtin:tiny") -> Proc:
    args = ["serve", "--model", model, "--port", "0"] + (["--layout", layout] if layout else [])
    return launch(*args, env=env)


def launch_many(specs: dict[str, tuple], pool: ThreadPoolExecutor) -> dict:
    """name -> Future[Proc], all starting at once (each spec: (layout, env))."""
    return {k: pool.submit(replica, *v) for k, v in specs.items()}


# ---- a loopback TCP proxy with faults -----------------------------------------------------------
class Proxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<upstream>. Faults fire once `after` more bytes
    have gone client→upstream since `arm()`:
      cut        close both sides of every open connection (RST), then pass again
      partition  cut, and refuse every later connection until `heal()`
      stall      stop forwarding client→upstream bytes (the peer hangs)
      garble     flip bytes client→upstream from then on (one connection's worth)
      garbage    answer the next response with junk instead of the upstream's bytes
      slow       sleep `delay` seconds per forwarded piece (always, once armed)
    `on_fire()` is called when the fault fires (e.g. to kill -9 a process there)."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.mode = "pass"
        self.after = 0
        self.delay = 0.0
        self.on_fire = None
        self.fired = threading.Event()
        self._up_total = 0
        self._fire_at: int | None = None
        self._partitioned = False
        self._garbage_pending = False
        self._writers: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start():
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]

        self.loop.run_until_complete(start())
        ready.set()
        self.loop.run_forever()

    def arm(self, mode: str, after: int = 0, delay: float = 0.0, on_fire=None) -> None:
        self.mode, self.after, self.delay, self.on_fire = mode, after, delay, on_fire
        self.fired.clear()
        self._fire_at = self._up_total + after

    def heal(self) -> None:
        self.mode, self._fire_at, self._partitioned, self._garbage_pending = "pass", None, False, False

    def close(self) -> None:
        async def shut():
            self.server.close()
            for w in list(self._writers):
                w.transport.abort()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()
            await asyncio.sleep(0.05)

        try:
            asyncio.run_coroutine_threadsafe(shut(), self.loop).result(5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)

    def _fire(self) -> None:
        self._fire_at = None
        self.fired.set()
        if self.on_fire:
            threading.Thread(target=self.on_fire, daemon=True).start()
        if self.mode in ("cut", "partition"):
            self._partitioned = self.mode == "partition"
            for w in list(self._writers):
                w.transport.abort()
            self.mode = "pass" if self.mode == "cut" else self.mode
        elif self.mode == "garbage":
            self._garbage_pending = True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._partitioned:
            writer.transport.abort()
            return
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, uw}

        async def up():
            while True:
                data = await reader.read(16384)
                if not data:
                    break
                if self.mode == "slow" and self._fire_at is not None and self._up_total >= self._fire_at:
                    await asyncio.sleep(self.delay)
                if self._fire_at is not None and self.mode != "slow" and self._up_total + len(data) > self._fire_at:
                    k = self._fire_at - self._up_total
                    mode = self.mode
                    if mode in ("cut", "partition"):
                        uw.write(data[:k])
                        self._up_total += k
                        self._fire()
                        return
                    if mode == "stall":
                        uw.write(data[:k])
                        self._up_total += k
                        self._fire()
                        await asyncio.sleep(3600)
                    if mode == "garble":
                        data = data[:k] + bytes(b ^ 0x5A for b in data[k:])
                        self._up_total += len(data)
                        self._fire()
                        uw.write(data)
                        while True:  # the rest of this connection is garbled too
                            data = await reader.read(16384)
                            if not data:
                                return
                            uw.write(bytes(b ^ 0x5A for b in data))
                    if mode == "garbage":
                        self._fire()
                self._up_total += len(data)
                uw.write(data)
                await uw.drain()

        async def down():
            while True:
                data = await ur.read(16384)
                if not data:
                    break
                if self._garbage_pending:
                    self._garbage_pending = False
                    self.mode = "pass"
                    writer.write(b"\x00\xffNOT HTTP AT ALL\r\n\r\n" + os.urandom(64))
                    await writer.drain()
                    writer.transport.abort()
                    return
                writer.write(data)
                await writer.drain()

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except Exception:  # noqa: BLE001
            pass
        finally:
            for t in tasks:
                t.cancel()
            for w in (writer, uw):
                self._writers.discard(w)
                try:
                    w.close()
                except Exception:  # noqa: BLE001
                    pass


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
def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if alive(p):
            out.append(p)
            todo += children_of(p)
    return out


def usage(pid: int) -> dict:
    """RSS (MiB) and open file descriptors of a replica: its driver plus every descendant."""
    rss, fds, procs = 0, 0, _tree(pid)
    for p in procs:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
    return {"rss_mb": round(rss / 1024, 1), "fds": fds, "processes": len(procs)}


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
    from migrate.live import MigrationError, migrate_live

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
                res = migrate_live(urls[src], urls[dst], small_bytes=0, max_rounds=2, timeout_s=60)
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
