"""The sessions `relayout bench migration` moves (relayout.bench.migration measures the moves): each
context is prefilled once, on the target, whose time to first token is the recompute figure; the
target checkpoints the session after its first tokens and lets it go; each move restores it on the
source, and the reference is the same checkpoint restored on the target, decoding undisturbed."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from relayout.bench.replica_client import BenchError, TokenStream, http_client

MAX_TOKENS = 1024  # "large": sessions are stopped by the bench, never by max_tokens

Log = Callable[[str], None]


def prompt(n: int, salt: int = 0) -> list[int]:
    rng = random.Random(1000 + salt)
    return [rng.randrange(32, 127) for _ in range(n)]  # printable bytes of the builtin byte vocabulary


@dataclass
class Ctx:
    src: str
    dst: str
    L: int
    ids: list[int]
    warm: int  # tokens the session makes after its prefill, before it is checkpointed (prefill_on_target)
    after: int  # tokens on the target after a move
    timeout: float
    log: Log
    sessions: dict = field(default_factory=dict)  # mode -> all tokens the session produced, in order
    transport: str | None = None  # how the source pushes the rounds (None: the replicas' default, tcp)
    checkpoint_dir: str | None = None  # where the replicas write checkpoints (a file:// store)
    checkpoint: str | None = None  # the session after its prefill and first tokens (prefill_on_target)
    source_cpus: set[int] | None = None  # where the source replica runs (hosts="split"), else None
    pids: tuple[int, ...] = ()  # the replicas' processes (their ranks are their children): the path's CPU


def completion(ids: list[int], max_tokens: int) -> dict:
    return {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}


def wait_idle(*urls: str, timeout: float = 30.0) -> None:
    """Until no replica holds a live session (aborts land at the next step boundary). A session
    still decoding would take CPU from the next measurement: past `timeout`, a BenchError."""
    t0 = time.time()
    for u in urls:
        while True:
            live = httpx.get(f"{u}/v1/replica", timeout=30).json()["sessions"]
            if not live:
                break
            if time.time() - t0 > timeout:
                raise BenchError(f"{u} still holds {len(live)} live session(s) after {timeout:.0f} s: {live[:3]}")
            time.sleep(0.05)


def prefill_on_target(c: Ctx) -> dict:
    """The context's one prefill: the session's prompt on the target, from the request to its first
    token (the recompute move's stall: an aborted session re-prefilled there). After `warm` tokens
    the target checkpoints the session and lets it go (`stop`); both moves and the reference start
    from that checkpoint (`_restored`), since a second prefill of the same prompt would cost
    minutes at 16k on a CPU."""
    r = TokenStream("POST", f"{c.dst}/v1/completions", completion(c.ids, MAX_TOKENS))
    r.wait_tokens(c.warm, c.timeout)
    if r.error is not None or len(r.tokens) < c.warm:
        raise BenchError(f"prefill on the target: {len(r.tokens)} tokens ({r.error!r})")
    ck = httpx.post(f"{c.dst}/v1/sessions/checkpoint",
                    json={"sessions": [r.sid], "stop": True, "destination": c.checkpoint_dir}, timeout=c.timeout)
    if ck.status_code >= 400:
        raise BenchError(f"checkpoint on the target: HTTP {ck.status_code}: {ck.text[:300]}")
    c.checkpoint = ck.json()["checkpoint"]
    r.finish(c.timeout)  # its stream ends with the checkpoint
    wait_idle(c.dst)
    return {"recompute_ms": round((r.times[0] - r.started_at) * 1000, 2), "estimated": False}


def restored(c: Ctx, url: str, then: Callable[[TokenStream], None] | None = None,
              stop_after: int | None = None) -> TokenStream:
    """The context's session restored on `url` from its checkpoint, streamed from its first token
    (`restored_with`: the tokens it had when restored)."""
    assert c.checkpoint is not None
    r = httpx.post(f"{url}/v1/sessions/restore", json={"checkpoint": c.checkpoint}, timeout=c.timeout)
    if r.status_code >= 400:
        raise BenchError(f"restore on {url}: HTTP {r.status_code}: {r.text[:300]}")
    sid = r.json()["sessions"][0]
    have = len(httpx.get(f"{url}/v1/sessions/{sid}", timeout=30).json()["token_ids"])
    s = TokenStream("GET", f"{url}/v1/sessions/{sid}/stream?from_token=0&return_token_ids=true", then=then,
                    stop_after=stop_after)
    s.restored_with = have  # type: ignore[attr-defined]
    return s


def warm_up(url: str, timeout: float) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt(64, salt=3), "max_tokens": 4, "temperature": 0},
                   timeout=timeout)
    if r.status_code >= 400:
        raise BenchError(f"warm-up request: HTTP {r.status_code}: {r.text[:300]}")


def reference(c: Ctx) -> list[int]:
    """The undisturbed run the moved sessions must match: the target's own session (its prefill,
    checkpointed there after its first tokens) restored on the target, where nothing moves it,
    decoding to as many tokens as the longest moved session holds."""
    n = max(len(v) for v in c.sessions.values())
    t = restored(c, c.dst, stop_after=n)
    t.finish(c.timeout)
    if len(t.tokens) < n:
        raise BenchError(f"reference: {len(t.tokens)} of {n} tokens ({t.error!r})")
    wait_idle(c.dst)
    return t.tokens[:n]


def attach_early(dst: str, sid: str) -> tuple[Callable[[], None], Callable[[], TokenStream | None]]:
    """Watch the target from the start of the move's final round (`begin`; polling all through
    pre-copy would take CPU from the source's decoding on a small box); once the session exists
    there (placed, held paused by the final round) stream it from its current token on. `done`
    ends the watch and gives that stream (None if it never attached)."""
    box: dict = {}
    quit_ = threading.Event()

    def watch() -> None:
        try:
            with http_client(timeout=30) as client:
                while not quit_.is_set():
                    # without the id lists: a 16k-token session's ids made this poll most of the target's CPU
                    r = client.get(f"{dst}/v1/sessions/{sid}", params={"token_ids": "false"})
                    # (the target also remembers the session's earlier life there, checkpointed or done)
                    # placed (held paused until the commit) is enough: its stream waits server-side for the
                    # pre-step's token, where polling on through that step took the target's CPU from it
                    if r.status_code == 200 and r.json().get("state") in ("running", "paused"):
                        k = r.json()["num_generated_tokens"]
                        box["s"] = TokenStream("GET", f"{dst}/v1/sessions/{sid}/stream?from_token={k}"
                                               "&return_token_ids=true")
                        return
                    quit_.wait(0.01)
        except httpx.HTTPError:
            return  # the target went away: nothing to attach to (the move fails and says why)

    th = threading.Thread(target=watch, daemon=True)

    def begin() -> None:
        if not th.is_alive() and th.ident is None:
            th.start()

    def done() -> TokenStream | None:
        quit_.set()
        if th.ident is not None:
            th.join(30)
        st = box.get("s")
        if st is not None:
            st.stop()
            st.join(30)
        return st

    return begin, done
