"""`relayout bench vllm`'s protection figures (docs/benchmarks.md), on the bench's two vLLM replicas:

- `decode_ratio_with_protection`: the source's decode (the median inter-token gap of a probe stream)
  without protection over the same while it is protected to the other replica (rounds every 16 tokens
  or 200 ms, the defaults), windows alternating, side by side per repetition;
- `failover_ms`: the source killed -9 (relayout's replica process and vLLM's server together) with a
  protected stream decoding; the time from the kill to the first token the standby streams, promoted
  as a gateway promotes it (with every token the client got); `failover_exact`: the stream, source then
  standby, equals the same request run undisturbed on the source before. Last: the source is gone after it."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable

import httpx
from relayout.bench.replica_client import BenchError, QuietLoud, TokenStream

WINDOW_S = 0.5
REPS = 4


def _protect(src: str, standby: str) -> str:
    r = httpx.post(f"{src}/v1/protection", json={"standby": standby}, timeout=30)
    if r.status_code != 200:
        raise BenchError(f"protect {src} -> {standby}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()["protection"]


def _wait_rounds(src: str, n: int, timeout: float = 60) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = httpx.get(f"{src}/v1/protection", timeout=10).json()
        if v.get("rounds", 0) >= n:
            return v
        time.sleep(0.01)
    raise BenchError(f"protection of {src} sent fewer than {n} rounds in {timeout:.0f}s")


def decode_with_protection(src: str, standby: str, max_tokens: int, seed: int = 0) -> dict:
    rnd = random.Random(seed)
    windows = QuietLoud()
    rounds = 0
    for _ in range(REPS):
        probe = TokenStream("POST", f"{src}/v1/completions", {
            "prompt": [rnd.randrange(1, 500) for _ in range(64)], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True})
        probe.wait_tokens(8, 120)
        t0 = time.perf_counter()
        time.sleep(WINDOW_S)
        t1 = time.perf_counter()
        _protect(src, standby)
        time.sleep(WINDOW_S)
        t2 = time.perf_counter()
        rounds += httpx.get(f"{src}/v1/protection", timeout=10).json()["rounds"]
        httpx.delete(f"{src}/v1/protection", timeout=30)
        probe.stop()
        probe.finish(120)
        windows.add(probe.times, t0, t1, t2)
    g_quiet, g_loud, ratio = windows.gaps_ms()
    return {"step_ms_unprotected": g_quiet, "step_ms_protected": g_loud, "protection_rounds": rounds,
            "decode_ratio_with_protection": ratio}


def failover(src: str, standby: str, kill: Callable[[int], None], max_tokens: int, seed: int = 1) -> dict:
    """Kill -9 the source mid-stream; promote on the standby with the client's tokens; its first token."""
    rnd = random.Random(seed)
    body = {"prompt": [rnd.randrange(1, 500) for _ in range(64)], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    # the same request undisturbed, first, on the source: greedy, so the failed-over stream must equal it
    undisturbed = httpx.post(f"{src}/v1/completions", json=body, timeout=600).json()["choices"][0]["token_ids"]
    pid = _protect(src, standby)
    s = TokenStream("POST", f"{src}/v1/completions", {**body, "stream": True})
    s.wait_tokens(64, 120)
    _wait_rounds(src, 3)
    killed = time.perf_counter()
    kill(signal.SIGKILL)
    s.join(60)  # cut with the source: its error is the kill's
    told = {s.sid: list(s.tokens)}
    r = httpx.post(f"{standby}/v1/standby/{pid}/promote", json={"tokens": told}, timeout=60)
    if r.status_code != 200:
        raise BenchError(f"promote on {standby}: HTTP {r.status_code}: {r.text[:300]}")
    rest = TokenStream("GET", f"{standby}/v1/sessions/{s.sid}/stream?from_token={len(s.tokens)}&return_token_ids=true")
    rest.wait_tokens(1, 60)
    first = rest.times[0]
    rest.finish(120)
    return {"failover_ms": round((first - killed) * 1000, 1), "promoted_tail_tokens": r.json()["tail_tokens"],
            "failover_lease_s": r.json()["promote_after_s"], "failover_tokens": len(s.tokens) + len(rest.tokens),
            "failover_exact": s.tokens + rest.tokens == undisturbed}
