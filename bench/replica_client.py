"""What the migration bench sees as a client: replica processes it launches (keeping the tail of
their output for error messages) and token streams timestamped on arrival.

Split from `relayout.bench.migration`, which measures with them."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from relayout.engine.web import tls_context
from relayout.migrate.procs import URL_RE


class BenchError(RuntimeError):
    pass


# ---- replicas --------------------------------------------------------------------------------------
class Replica:
    def __init__(self, model: str, layout: str, kv_cache_mb: int, device: str | None = None,
                 cpus: set[int] | None = None, env: dict[str, str] | None = None):
        args = [sys.executable, "-m", "relayout.agent.cli", "serve", "--model", model, "--layout", layout, "--port", "0",
                "--kv-cache-mb", str(kv_cache_mb)]
        if device:
            args += ["--device", device]
        self.layout = layout
        self.tail: list[str] = []
        # `cpus`: the replica (its ranks too, which inherit it) runs only there, as on a host of its own
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        self.url = ""

    def wait_ready(self, timeout: float = 300.0) -> str:
        t0 = time.time()
        assert self.proc.stdout is not None
        while time.time() - t0 < timeout:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise BenchError(f"replica {self.layout} exited with {self.proc.returncode}: {''.join(self.tail[-20:])}")
            self.tail = (self.tail + [line])[-50:]
            m = URL_RE.search(line)
            if m and "serving" in line:
                self.url = m.group(1)
                threading.Thread(target=self._drain, daemon=True).start()
                return self.url
        raise BenchError(f"replica {self.layout} did not start within {timeout:.0f}s")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail = (self.tail + [line])[-50:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def http_client(**kw: Any) -> httpx.Client:
    """An httpx client with the process's one TLS context (engine.web.tls_context). One made without
    it loads the CA bundle, ~17 ms of CPU here: a reattaching stream made inside the stall it measures,
    or a poll beside the decoding, took that from the replicas on a 2-core box."""
    return httpx.Client(verify=tls_context(), **kw)


# ---- one session's token stream, timestamped on arrival ---------------------------------------------------
class TokenStream(threading.Thread):
    """Consumes one SSE stream (POST /v1/completions or GET /v1/sessions/{id}/stream) in a thread,
    recording every token id with its arrival time. It disconnects by itself after `stop_after`
    tokens, or after `stop()` at the next token, and then aborts the session explicitly (a bare
    disconnect only detaches it for the replica's grace period)."""

    def __init__(self, method: str, url: str, body: dict | None = None, stop_after: int | None = None,
                 retry_404_s: float = 0.0, then: Callable[[TokenStream], None] | None = None):
        super().__init__(daemon=True)
        self.method, self.url, self.body = method, url, body
        self.stop_after, self.retry_404_s, self.then = stop_after, retry_404_s, then
        self.follower: TokenStream | None = None  # what `then` started, if anything
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.sid: str | None = None
        self.done = False  # [DONE] seen: finished here (not migrated)
        self.error: BaseException | None = None
        self.started_at = time.perf_counter()
        self.opened_at: float | None = None  # response headers in
        self.closed_at: float | None = None
        self._stopping = False
        self._cond = threading.Condition()
        self.start()

    def run(self) -> None:
        try:
            with http_client(timeout=httpx.Timeout(None, connect=30.0)) as client:
                deadline = time.perf_counter() + self.retry_404_s
                while True:
                    with client.stream(self.method, self.url, json=self.body) as r:
                        if r.status_code == 404 and time.perf_counter() < deadline:
                            r.read()
                            time.sleep(0.005)
                            continue
                        if r.status_code >= 400:
                            r.read()
                            raise BenchError(f"{self.method} {self.url}: HTTP {r.status_code}: {r.text[:300]}")
                        self.opened_at = time.perf_counter()
                        hung_up = self._consume(r)
                        self.closed_at = time.perf_counter()
                    if hung_up and self.sid:
                        base = self.url.split("/v1/", 1)[0]
                        client.post(f"{base}/v1/sessions/{self.sid}/abort", timeout=30.0)
                    break
            if self.then is not None and not self.done:
                self.then(self)  # at once, on this thread: e.g. reattach to the session on the target
        except BaseException as e:  # noqa: BLE001 - reported to the waiting side
            self.error = e
        finally:
            with self._cond:
                if self.closed_at is None:
                    self.closed_at = time.perf_counter()
                self._cond.notify_all()

    def _consume(self, r: httpx.Response) -> bool:
        """Reads the stream; True when this side hung up (stop / stop_after) before its end."""
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                self.done = True
                return False
            now = time.perf_counter()
            obj = json.loads(data)
            if "error" in obj:
                raise BenchError(f"stream error: {obj['error']}")
            ids = (obj.get("choices") or [{}])[0].get("token_ids") or []
            with self._cond:
                self.sid = self.sid or obj.get("id")
                self.tokens += ids
                self.times += [now] * len(ids)
                self._cond.notify_all()
            if self._stopping or (self.stop_after is not None and len(self.tokens) >= self.stop_after):
                return True  # leaving the `with` closes the connection; the caller aborts the session
        return False  # the stream ended without [DONE]: the session moved on

    def wait_tokens(self, n: int, timeout: float) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.tokens) >= n or not self.is_alive() or self.error is not None,
                                     timeout)
        if self.error is not None:
            raise BenchError(f"stream {self.url}: {self.error}") from self.error
        if not ok or len(self.tokens) < n:
            raise BenchError(f"stream {self.url}: {len(self.tokens)} tokens, wanted {n} (timeout {timeout:.0f}s)")

    def finish(self, timeout: float) -> None:
        self.join(timeout)
        if self.is_alive():
            raise BenchError(f"stream {self.url} did not end within {timeout:.0f}s")
        if self.error is not None:
            raise BenchError(f"stream {self.url}: {self.error}") from self.error

    def stop(self) -> None:
        self._stopping = True


def gaps(times: list[float]) -> list[tuple[float, float]]:
    """(start, end) of each inter-token gap (tokens that arrived in one batch share a time)."""
    ts = sorted(set(times))
    return list(zip(ts, ts[1:], strict=False))


def median_gap_ms(times: list[float]) -> float | None:
    g = [b - a for a, b in gaps(times)]
    return round(statistics.median(g) * 1000, 2) if g else None


class QuietLoud:
    """A probe stream's token times in alternating windows, quiet (without the work measured) and loud
    (with it): the median inter-token gap of each, and quiet over loud (the decode rate kept)."""

    def __init__(self) -> None:
        self.quiet: list[float] = []
        self.loud: list[float] = []

    def add(self, times: list[float], t0: float, t1: float, t2: float) -> None:
        """[t0, t1) was quiet, [t1, t2) loud."""
        self.quiet += [t for t in times if t0 <= t < t1]
        self.loud += [t for t in times if t1 <= t < t2]

    def gaps_ms(self) -> tuple[float | None, float | None, float | None]:
        q, lo = median_gap_ms(self.quiet), median_gap_ms(self.loud)
        return q, lo, (round(q / lo, 3) if q and lo else None)


# ---- the link ------------------------------------------------------------------------------------------
DISTINCT_MAX = 1 << 30  # a distinct copy's buffers (each end's) wrap around beyond this
_SENDER = f"DISTINCT_MAX = {DISTINCT_MAX}\n" + """
import os, socket, sys, time
n, port, nice, seconds, mbps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
distinct = sys.argv[6] == "1"
# as migrate.transport.base.background_thread lowers a pre-copy worker; not imported from there: it
# loads torch, seconds in which a short session on the measured replica may finish decoding
if nice == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
elif int(nice):
    os.nice(int(nice))
# paced at `mbps` (0: as fast as it goes): pieces of about 10 ms of the rate, as a replication's small rounds
buf = memoryview(bytearray(min(4 << 20, max(64 << 10, int(mbps * 1e4))) if mbps > 0 else 4 << 20))
if distinct:  # every byte sent from memory of its own (as a round's chunks are), paged in beforehand
    src = bytearray(min(n, DISTINCT_MAX))
    src[::4096] = b"\1" * len(src[::4096])
t0 = time.monotonic()
end = t0 + seconds if seconds > 0 else float("inf")
with socket.create_connection(("127.0.0.1", port)) as s:
    c0, sent = time.process_time(), 0
    while n > 0 and time.monotonic() < end:
        k = min(n, len(buf))
        s.sendall(buf[:k] if not distinct else memoryview(src)[sent % len(src):][:k])
        n, sent = n - k, sent + k
        if mbps > 0 and (ahead := sent / (mbps * 1e6) - (time.monotonic() - t0)) > 0:
            time.sleep(ahead)
    print(time.process_time() - c0)  # the send loop's CPU seconds (the copy's, not the interpreter's start)
"""


def split_cpus(cpus: set[int]) -> tuple[set[int], set[int]]:
    """Two halves of `cpus`, standing for two hosts (one CPU: both get it)."""
    ordered = sorted(cpus)
    half = max(1, len(ordered) // 2)
    return set(ordered[:half]), set(ordered[half:]) or set(ordered)


@dataclass
class LinkCopy:
    """One plain socket copy: GB/s (1e9 bytes/s), and when it ran (time.perf_counter, as the
    TokenStreams' times)."""

    gbps: float
    started: float
    ended: float
    cpu_s: float = 0.0  # both ends' CPU seconds over the copy (the sender's send loop, the receiver's thread)

    def cpu_s_per_gb(self, nbytes: int) -> float | None:
        return self.cpu_s / (nbytes / 1e9) if nbytes > 0 else None


def link_copy(nbytes: int = 512 << 20, sender_cpus: set[int] | None = None, nice: int | str = 0,
              seconds: float = 0.0, mbps: float = 0.0, distinct: bool = False) -> LinkCopy:
    """A plain TCP socket copy of `nbytes` (or for `seconds`, if that ends first) from another
    process (on `sender_cpus`, default anywhere) to this one, over loopback (where the bench's
    replicas talk): what the link itself moves. `nice`: both ends at that priority (a nice value,
    or "idle" for SCHED_IDLE), as pre-copy's workers run (migrate.transport.base.precopy_nice): beside
    a decoding replica, what the link still moves for them. `mbps`: the sender paced at that many
    MB/s (a replication's byte rate), not as fast as it goes. `distinct`: every byte from (and into)
    memory of its own, paged in before the copy (up to DISTINCT_MAX each end), as a migration's
    round reads its chunks out of memory, not one 4 MiB buffer over and over that stays in the
    cache (what the plain probe sends: the link's best case)."""
    import socket

    from relayout.migrate.transport.base import background_thread

    res: dict[str, float | int] = {}
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        p = subprocess.Popen([sys.executable, "-c", _SENDER, str(nbytes), str(port), str(nice), str(seconds), str(mbps), "1" if distinct else "0"],
                             stdout=subprocess.PIPE, text=True,
                             preexec_fn=(lambda: os.sched_setaffinity(0, sender_cpus)) if sender_cpus else None)

        def receive() -> None:
            if nice:  # on a thread of its own: a thread's priority cannot be raised back
                background_thread(nice)
            dst = bytearray(min(nbytes, DISTINCT_MAX) if distinct else 4 << 20)
            if distinct:
                dst[::4096] = b"\1" * len(dst[::4096])  # paged in before the clock starts
            conn, _ = srv.accept()
            with conn:
                whole = memoryview(dst)
                got, t0, c0 = 0, time.perf_counter(), time.thread_time()
                while got < nbytes:
                    k = conn.recv_into(whole[got % len(dst):][: 4 << 20])
                    if k == 0:
                        break
                    got += k
                res.update(got=got, t0=t0, t1=time.perf_counter(), cpu=time.thread_time() - c0)

        try:
            t = threading.Thread(target=receive, name="link-probe", daemon=True)
            t.start()
            t.join(120)
        finally:
            out, _ = p.communicate(timeout=60)
    got = int(res.get("got", 0))
    # a timed probe at a low priority may move nothing on a busy machine: that is its measurement
    # (0 GB/s, reported as no figure), not a failure; a copy of all the bytes must deliver them
    if "t1" not in res or (not seconds and got < nbytes):
        raise BenchError(f"link probe: {got} of {nbytes} bytes arrived")
    try:
        sender_cpu = float(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        sender_cpu = 0.0
    return LinkCopy(got / (res["t1"] - res["t0"]) / 1e9, res["t0"], res["t1"], sender_cpu + float(res.get("cpu", 0.0)))


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and all its descendants so far (Linux /proc): a
    replica with its rank processes."""
    from relayout.migrate.procs import children_of, proc_cpu_s

    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        cpu = proc_cpu_s(p)
        if cpu is None:
            continue
        total += cpu
        todo += children_of(p)
    return total


def link_gbps(nbytes: int = 512 << 20, sender_cpus: set[int] | None = None, nice: int | str = 0) -> float:
    """link_copy's GB/s."""
    return link_copy(nbytes, sender_cpus, nice).gbps
