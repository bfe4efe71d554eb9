"""`relayout bench replication`: what protection (continuous replication to a standby) costs and
what it saves (docs/benchmarks.md).

- decode tokens/s of one replica serving 8 concurrent sessions, unprotected vs protected at
  `every_tokens`, in the same run: `reps` pairs, each an unprotected run then a protected one right
  after it; `decode_ratio_with_replication` is the median of the pairs' ratios (the two runs of a
  pair see about the same background load, which the best of each figure taken apart does not);
  with `hosts="split"` (the default where there are 2 or more CPUs) the source replica runs on the
  first half of this process's CPUs and the standby and the clients on the other half, as on two
  hosts: the ratio is then what replication costs the source itself, not the standby's import
  competing with the source's decode for the same cores (`hosts="shared"` measures that);
- the replication lag seen meanwhile (max over sessions, sampled);
- a `kill -9` of the protected source (every process) mid-stream: the client tells the standby the
  tokens it got, promotes, reattaches; `failover_ms` is kill -> first token from the standby,
  client side; every output is compared with an undisturbed run: lost, repeated, changed tokens."""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable

import httpx
from relayout.bench.replica_client import http_client, link_copy, split_cpus
from relayout.engine.web import tls_context
from relayout.migrate import procs

Log = Callable[[str], None]
LAG_SAMPLE_S = 0.1


def _bodies(n: int, max_tokens: int) -> list[dict]:
    """Greedy and seeded sessions of different prompt and output lengths."""
    out = []
    for i in range(n):
        b = {"prompt": "the quick brown fox " * (2 + 3 * i), "max_tokens": max_tokens + 16 * i, "ignore_eos": True}
        b.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": 7 + i})
        out.append(b)
    return out


def _reference(url: str, body: dict) -> list[int]:
    # (every request here passes the process's TLS context: see replica_client.http_client)
    r = httpx.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}, verify=tls_context(), timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _decode_rate(url: str, bodies: list[dict], lag: list[int] | None = None) -> float:
    """Generated tokens/s of the bodies run concurrently (non-streamed). `GET /v1/protection` is
    asked every LAG_SAMPLE_S in either case (the same load on both figures); with `lag`, the
    replication lag it shows is kept there."""
    counts: list[int] = []
    stop = threading.Event()

    def one(b: dict) -> None:
        counts.append(len(_reference(url, b)))

    def watch() -> None:
        with http_client(timeout=5) as client:  # one for all samples (an httpx.get each made a client)
            while not stop.is_set():
                try:
                    r = client.get(f"{url}/v1/protection")
                    if lag is not None:
                        lag.append(r.json()["max_lag_tokens"])
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                stop.wait(LAG_SAMPLE_S)

    threads = [threading.Thread(target=one, args=(b,)) for b in bodies]
    w = threading.Thread(target=watch)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    w.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    stop.set()
    w.join()
    return sum(counts) / dt


class _Client(threading.Thread):
    """A stream from the source; after it breaks: promote on the standby with the tokens got, reattach."""

    def __init__(self, source: str, body: dict):
        super().__init__(daemon=True)
        self.source, self.body = source, body
        self.tokens: list[int] = []
        self.sid: str | None = None
        self.target: tuple[str, str] | None = None  # (standby URL, protection id), once killed
        self.go = threading.Event()
        self.first_after: float | None = None
        self.broken_at: float | None = None  # when the source's stream ended (time.monotonic)
        self.promoted_at: float | None = None  # when the standby answered the promotion
        self.error: str | None = None
        self.start()

    def _consume(self, r: httpx.Response, after: bool) -> bool:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:] == "[DONE]":
                return True
            obj = json.loads(line[6:])
            self.sid = self.sid or obj.get("id")
            ids = obj.get("choices", [{}])[0].get("token_ids") or []
            if ids and after and self.first_after is None:
                self.first_after = time.monotonic()
            self.tokens += ids
        return False

    def run(self) -> None:
        try:
            try:
                with httpx.stream("POST", f"{self.source}/v1/completions", verify=tls_context(), timeout=120,
                                  json={**self.body, "stream": True, "return_token_ids": True}) as r:
                    if self._consume(r, False):
                        return
            except httpx.HTTPError:
                pass
            self.broken_at = time.monotonic()
            if not self.go.wait(120) or self.target is None or self.sid is None:
                raise RuntimeError("no failover target")
            standby, pid = self.target
            r = httpx.post(f"{standby}/v1/standby/{pid}/promote", json={"tokens": {self.sid: self.tokens}},
                           verify=tls_context(), timeout=60)
            r.raise_for_status()
            self.promoted_at = time.monotonic()
            with httpx.stream("GET", f"{standby}/v1/sessions/{self.sid}/stream", verify=tls_context(), timeout=120,
                              params={"from_token": len(self.tokens), "return_token_ids": "true"}) as r:
                r.raise_for_status()
                self._consume(r, True)
        except Exception as e:  # noqa: BLE001 - reported in the figures
            self.error = f"{type(e).__name__}: {e}"


def _beside_bare_copy(url: str, bodies: list[dict], mbps: float, seconds: float, sender_cpus: set[int]) -> float:
    """_decode_rate of the bodies while a bare socket copy at `mbps` runs for `seconds` (about the
    decode's length) from a process on `sender_cpus` to this one."""
    copy = threading.Thread(target=link_copy, args=(int(mbps * 1e6 * seconds * 2) + (1 << 20), sender_cpus),
                            kwargs={"seconds": seconds, "mbps": mbps}, daemon=True)
    copy.start()
    try:
        return _decode_rate(url, bodies)
    finally:
        copy.join(seconds + 60)


def _failover_parts(clients: list[_Client], killed: float) -> dict:
    done = [c for c in clients if None not in (c.broken_at, c.promoted_at, c.first_after)]
    if not done:
        return {}
    c = min(done, key=lambda c: c.first_after)  # type: ignore[arg-type, return-value]
    ms = lambda a, b: round((b - a) * 1000, 1)  # noqa: E731
    return {"failover_detect_ms": ms(killed, c.broken_at), "failover_promote_ms": ms(c.broken_at, c.promoted_at),
            "failover_reattach_ms": ms(c.promoted_at, c.first_after)}


def _kill_tree(p: procs.Proc) -> None:
    for pid in procs.process_tree(p.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.kill()


def _protect(source: str, standby: str, every_tokens: int) -> dict:
    r = httpx.post(f"{source}/v1/protection", json={"standby": standby, "every_tokens": every_tokens}, verify=tls_context(), timeout=30)
    r.raise_for_status()
    return r.json()


def compare(got: list[int], ref: list[int]) -> dict[str, int]:
    """Tokens lost (missing at the end), repeated (extra), changed (different at the same position)."""
    n = min(len(got), len(ref))
    return {"lost": max(0, len(ref) - len(got)), "repeated": max(0, len(got) - len(ref)),
            "changed": sum(1 for a, b in zip(got[:n], ref[:n], strict=True) if a != b)}


def _start_replicas(model: str, args: tuple[str, ...], hosts: str) -> tuple[procs.Proc, procs.Proc, dict]:
    """The source and the standby; with `hosts="split"` each starts with (inherits) its own CPUs
    and this process keeps the standby's, so the clients do not run on the source's either."""
    mine = os.sched_getaffinity(0)
    if hosts == "split" and len(mine) >= 2:
        src_cpus, other = split_cpus(mine)  # (the source's, the standby's and the clients')
        os.sched_setaffinity(0, src_cpus)
        try:
            src = procs.replica(model=model, args=args)
        finally:
            os.sched_setaffinity(0, other)
        return src, procs.replica(model=model, args=args), {"hosts": "split", "source_cpus": sorted(src_cpus),
                                                            "standby_and_client_cpus": sorted(other)}
    return (procs.replica(model=model, args=args), procs.replica(model=model, args=args),
            {"hosts": "shared", "source_cpus": sorted(mine), "standby_and_client_cpus": sorted(mine)})


def run(model: str = "builtin:tiny", every_tokens: int = 16, sessions: int = 8, max_tokens: int = 256,
        reps: int = 5, device: str | None = None, log: Log = print, hosts: str = "split") -> dict:
    if hosts not in ("split", "shared"):
        raise ValueError(f"hosts must be 'split' or 'shared', not {hosts!r}")
    args = ("--device", device) if device else ()
    log(f"starting two {model} replicas ({hosts} CPUs)")
    mine = os.sched_getaffinity(0)
    src, sb, placement = _start_replicas(model, args, hosts)
    try:
        bodies = _bodies(sessions, max_tokens)
        # warm up with the whole load: after two sessions only, the first rep's unprotected run was
        # still the slowest of all (its ratios 1.06-1.14 where the others' were 0.90-0.95)
        _decode_rate(src.url, bodies)
        plain, protected, bare, lag, engine_ms, mbps, fences = [], [], [], [], [], [], 0
        for i in range(reps):
            log(f"rep {i + 1}/{reps}: unprotected")
            plain.append(_decode_rate(src.url, bodies))
            _protect(src.url, sb.url, every_tokens)
            log(f"rep {i + 1}/{reps}: protected (every {every_tokens} tokens)")
            t0 = time.perf_counter()
            protected.append(_decode_rate(src.url, bodies, lag))
            seconds = time.perf_counter() - t0
            view = httpx.get(f"{src.url}/v1/protection", verify=tls_context(), timeout=30).json()
            engine_ms.append(view["engine_ms_per_round"])
            fences += view["fences"]
            mbps.append(view["bytes"] / seconds / 1e6)  # (the first rep's includes the first full sync)
            httpx.delete(f"{src.url}/v1/protection", verify=tls_context(), timeout=30)
            # the yardstick: the same byte rate over a bare socket from the source's CPUs to the
            # standby's, beside unprotected decoding (what any transport at that rate leaves of it)
            log(f"rep {i + 1}/{reps}: unprotected beside a bare copy at {mbps[-1]:.1f} MB/s")
            bare.append(_beside_bare_copy(src.url, bodies, mbps[-1], seconds, set(placement["source_cpus"])))
        ratios = [b / a for a, b in zip(plain, protected, strict=True)]
        bare_ratios = [b / a for a, b in zip(plain, bare, strict=True)]
        log("references for the failover")
        long_bodies = _bodies(sessions, max_tokens * 4)
        refs = [_reference(sb.url, b) for b in long_bodies]
        pid = _protect(src.url, sb.url, every_tokens)["protection"]
        clients = [_Client(src.url, b) for b in long_bodies]
        end = time.monotonic() + 120
        while time.monotonic() < end and not all(len(c.tokens) >= 24 for c in clients):
            time.sleep(0.01)
        while time.monotonic() < end and httpx.get(f"{src.url}/v1/protection", verify=tls_context(), timeout=5).json()["rounds"] < 2:
            time.sleep(0.01)
        log("kill -9 of the source")
        killed = time.monotonic()
        _kill_tree(src)
        for c in clients:
            c.target = (sb.url, pid)
            c.go.set()
        for c in clients:
            c.join(300)
        diffs = [compare(c.tokens, r) for c, r in zip(clients, refs, strict=True)]
        firsts = [c.first_after - killed for c in clients if c.first_after is not None]
        return {
            "model": model, "sessions": sessions, "every_tokens": every_tokens, **placement,
            "decode_tok_s": round(statistics.median(plain), 1),
            "decode_tok_s_protected": round(statistics.median(protected), 1),
            "decode_ratio_with_replication": round(statistics.median(ratios), 3),
            "decode_ratio_pairs": [round(r, 3) for r in ratios],
            "replication_mbps": round(statistics.median(mbps), 2),
            # unprotected decode beside a bare socket copy at the replication's byte rate, against
            # the unprotected run of the same rep (median over reps)
            "bare_copy_decode_ratio": round(statistics.median(bare_ratios), 3),
            "bare_copy_decode_pairs": [round(r, 3) for r in bare_ratios],
            "fences": fences,  # times a protected run's lease lapsed on the source (each paused its sessions)
            "replication_lag_tokens_max": max(lag, default=0),
            "replication_lag_tokens_median": sorted(lag)[len(lag) // 2] if lag else 0,
            "engine_ms_per_round": round(min(engine_ms), 3),
            "failover_ms": round(min(firsts) * 1000, 1) if firsts else None,
            "failover_ms_max": round(max(firsts) * 1000, 1) if firsts else None,
            # where the fastest session's failover went: the client seeing its stream end, the promotion, the first token
            **_failover_parts(clients, killed),
            "failed_over_sessions": len(firsts),
            "lost_tokens": sum(d["lost"] for d in diffs), "repeated_tokens": sum(d["repeated"] for d in diffs),
            "changed_tokens": sum(d["changed"] for d in diffs),
            "client_errors": [c.error for c in clients if c.error],
            "goals": {
                "decode_ge_0.95x_bare_copy": statistics.median(ratios) >= 0.95 * statistics.median(bare_ratios),
                "failover_le_1s": bool(firsts) and min(firsts) <= 1.0,
            },
        }
    finally:
        os.sched_setaffinity(0, mine)
        _kill_tree(src)
        sb.stop()


def print_table(res: dict, console) -> None:
    console.print(f"replication ({res['model']}, {res['sessions']} sessions, every {res['every_tokens']} tokens; "
                  f"source on CPUs {res['source_cpus']}, standby and clients on {res['standby_and_client_cpus']})")
    console.print(f"  decode tok/s: {res['decode_tok_s']} unprotected, {res['decode_tok_s_protected']} protected "
                  f"-> ratio {res['decode_ratio_with_replication']}; beside a bare copy at the replication's "
                  f"{res['replication_mbps']} MB/s: {res['bare_copy_decode_ratio']} (lease lapses: {res['fences']})")
    console.print(f"  lag tokens: median {res['replication_lag_tokens_median']}, max {res['replication_lag_tokens_max']}; "
                  f"engine thread per round: {res['engine_ms_per_round']} ms")
    console.print(f"  kill -9 failover: first token after {res['failover_ms']} ms (last session {res['failover_ms_max']} "
                  f"ms), {res['failed_over_sessions']} sessions; lost {res['lost_tokens']}, repeated "
                  f"{res['repeated_tokens']}, changed {res['changed_tokens']}")
    if "failover_detect_ms" in res:
        console.print(f"  first session: stream end seen after {res['failover_detect_ms']} ms, promoted "
                      f"{res['failover_promote_ms']} ms later, first token {res['failover_reattach_ms']} ms after that")
    console.print(f"  goals: {res['goals']}")
