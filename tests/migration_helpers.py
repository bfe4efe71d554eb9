"""Clients for process-level migration tests: SSE streams that follow a session to whichever
replica ends up owning it (like the gateway), reference outputs, and polling helpers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx
import pytest
from relayout.migrate.live import MigrationResult, migrate_live

T = TypeVar("T")


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def reference(url: str, body: dict) -> list[int]:
    """The token ids of an undisturbed, non-streamed run of `body`."""
    r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "return_token_ids": True}, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def replica_state(url: str) -> dict:
    return httpx.get(f"{url}/v1/replica", timeout=10).json()


def wait_for(pred: Callable[[], T], timeout: float = 20, every: float = 0.1) -> T | None:
    """Poll `pred` until it returns something truthy (returned) or `timeout` passes (its last value)."""
    end = time.time() + timeout
    last = None
    while time.time() < end:
        last = pred()
        if last:
            return last
        time.sleep(every)
    return last


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


# ---- the arrange / migrate / finish shape of the fault tests ---------------------------------------
def streams_on(src: str, bodies: list[dict], follow: list[str]) -> list[Stream]:
    """One following stream per body on `src`, each started (tokens flowing)."""
    ss = [Stream(src, b, follow) for b in bodies]
    for s in ss:
        assert s.started.wait(60)
    return ss


@dataclass
class Moved:
    """What one arranged migration left: the streams, and the result or the error it ended with."""

    streams: list[Stream]
    result: MigrationResult | None = None
    error: BaseException | None = None
    seconds: float = 0.0


def migrate_with_streams(src: str, target: str, follow: list[str], bodies: list[dict], *,
                         arm: Callable[[], object] | None = None, raises: type[BaseException] | None = None,
                         match: str | None = None, **kw) -> Moved:
    """The shape of every migration fault: streams of `bodies` on `src` (followed to `follow`),
    then `arm()` (the fault), then migrate_live(src, target, small_bytes=0, **kw) — which must
    raise `raises` (matching `match`) when given."""
    m = Moved(streams_on(src, bodies, follow))
    if arm is not None:
        arm()
    t0 = time.time()
    if raises is None:
        m.result = migrate_live(src, target, small_bytes=0, **kw)
    else:
        with pytest.raises(raises, match=match) as ei:
            migrate_live(src, target, small_bytes=0, **kw)
        m.error = ei.value
    m.seconds = time.time() - t0
    return m


def finish(ss: list[Stream], refs: list[list[int]], where: str) -> None:
    """Every stream ended with the undisturbed tokens, last served by `where`."""
    for i, s in enumerate(ss):
        s.join(120)
        assert s.error is None, s.error
        assert s.tokens == refs[i], f"session {i} changed ({len(s.tokens)} tokens)"
        assert s.owners[-1] == where, (i, s.owners)


def unchanged(ss: list[Stream], refs: list[list[int]]) -> None:
    """Every stream ended with the undisturbed tokens, wherever it finished."""
    for i, s in enumerate(ss):
        s.join(120)
        assert s.error is None and s.tokens == refs[i]


def finish_moved(m: Moved, refs: list[list[int]], target: str, source: str) -> None:
    """Every stream ended with the undisturbed tokens; the moved sessions last served by `target`,
    the others (finished before the final round) by `source`."""
    assert m.result is not None and m.result.sessions
    for i, s in enumerate(m.streams):
        s.join(120)
        assert s.error is None and s.tokens == refs[i]
        assert s.owners[-1] == (target if s.sid in m.result.sessions else source), (i, s.owners)


def idle(url: str, timeout: float = 10) -> None:
    """No sessions and no KV blocks left on the replica (reservations included)."""
    st = wait_for(lambda: (lambda r: r if not r["sessions"] and r["kv_blocks_used"] == 0 else None)(replica_state(url)),
                  timeout)
    assert st, replica_state(url)


def no_transfers(url: str, tid: str) -> dict:
    return httpx.get(f"{url}/v1/sessions/transfers/{tid}", timeout=5).json()


def transfers_on(url: str, ids: list[str]) -> list[str]:
    """Those of `ids` that the replica at `url` knows (live or recently ended)."""
    return [tid for tid in ids if (lambda st: st["incoming"] or st["outgoing"])(no_transfers(url, tid))]


def record_transfer_ids(monkeypatch: pytest.MonkeyPatch, seen: list[str]) -> None:
    """From now on, append to `seen` (emptied first) the id of every transfer migrate_live starts."""
    import uuid

    import relayout.migrate.live as live

    real = uuid.uuid4
    seen.clear()

    def rec():
        u = real()
        seen.append(f"mig-{u.hex[:16]}")
        return u

    monkeypatch.setattr(live.uuid, "uuid4", rec)
