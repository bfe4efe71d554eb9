"""Clients for process-level migration tests: SSE streams that follow a session to whichever
replica ends up owning it (like the gateway), reference outputs, and polling helpers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

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
