"""Where the gateway's sessions are, and one client stream kept alive across whatever happens to its
replica (docs/gateway.md).

The gateway keeps no state a restart would lose: a session is found by asking every replica of
its agents (`GET /v1/replicas` on each agent, then `GET /v1/sessions/{id}` on each replica), with a
cache of where each was last seen. A stream whose session moved (`migrated_to`), was checkpointed
with `stop` (finish_reason "checkpointed"), or whose replica died (connection cut, engine error
event) is held open for up to RELAYOUT_REATTACH_WAIT_S (default 120 s) while the session is looked
for; once it runs again somewhere the stream reattaches at the next token
(`/v1/sessions/{id}/stream?from_token=N`). Past the bound the client gets an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from relayout.engine.api.streaming import SSEResponse, streaming_response
from relayout.engine.web import bearer_headers, error_response, json_object
from relayout.migrate.gateway.failover import Promoter
from relayout.storage.settings import settings

MAX_HOPS = 16  # moves, checkpoints and failovers one request follows
LIVE_STATES = ("running", "finished")  # a session that streams its tokens (to the end) where it is
_PREFERENCE = {"running": 0, "finished": 1, "checkpointed": 2, "migrated": 3}
_MAX_REMEMBERED = 65536
_PENDING_ABORTS: set[asyncio.Task] = set()
T = TypeVar("T")
log = logging.getLogger("relayout.gateway")


def reattach_wait_s() -> float:
    return settings().reattach_wait_s


class Upstreams:
    """Replica URLs, from agents (`GET /v1/replicas`) and/or given directly, and where sessions were seen."""

    def __init__(self, agents: list[str], replicas: list[str], token: str | None):
        self.agents = [a.rstrip("/") for a in agents]
        self.static = [r.rstrip("/") for r in replicas]
        self.token = token
        self.active: dict[str, int] = {}
        self._cache: tuple[float, list[dict]] = (0.0, [])
        self.where: OrderedDict[str, str] = OrderedDict()  # session id -> replica URL it was last seen on
        self.promoter = Promoter()  # protected replicas' standbys, and the promotions asked for

    def headers(self, client_auth: str | None = None) -> dict[str, str]:
        """Upstream headers: the replica token when there is one, else the client's own key (passed on)."""
        if self.token:
            return bearer_headers(self.token)
        return {"Authorization": client_auth} if client_auth else {}

    async def _replicas(self, client: httpx.AsyncClient, max_age: float = 2.0) -> list[dict]:
        """Every replica of every reachable agent (`url`, `status`, `draining`), plus the static ones."""
        at, cached = self._cache
        if self.agents and cached and time.monotonic() - at < max_age:
            return cached
        reps = [{"url": u} for u in self.static]
        for a in self.agents:
            try:
                r = await client.get(f"{a}/v1/replicas", headers=self.headers(), timeout=5)
                body = r.json()
                items = body if isinstance(body, list) else body.get("replicas", [])
                listed = [{**rep, "url": rep["url"].rstrip("/")} for rep in items
                          if isinstance(rep, dict) and isinstance(rep.get("url"), str)]
                for rep in listed:
                    self.promoter.learn(rep["url"], rep.get("protected_to"))
                reps += listed
            except (httpx.HTTPError, ValueError, AttributeError):
                continue  # an unreachable agent's replicas are not offered
        self._cache = (time.monotonic(), reps)
        return reps

    async def candidates(self, client: httpx.AsyncClient) -> list[str]:
        """Replicas that take new requests: running and not draining."""
        return [r["url"] for r in await self._replicas(client)
                if r.get("status", "running") == "running" and not r.get("draining")]

    async def pick(self, client: httpx.AsyncClient) -> str:
        urls = await self.candidates(client)
        if not urls:
            raise LookupError("no replica is available")
        return min(urls, key=lambda u: (self.active.get(u, 0), urls.index(u)))

    def seen(self, sid: str, url: str) -> None:
        self.where[sid] = url
        self.where.move_to_end(sid)
        while len(self.where) > _MAX_REMEMBERED:
            self.where.popitem(last=False)

    async def locate(self, client: httpx.AsyncClient, sid: str, auth: str | None = None,
                     fresh: bool = False) -> tuple[str, dict] | None:
        """The replica that has session `sid` and what it says of it: running, else finished, else
        checkpointed, else migrated (the last two say where it went). None: no replica knows it."""
        hint = self.where.get(sid)
        if hint is not None and not fresh:
            info = await self._ask(client, hint, sid, auth)
            if info is not None and info.get("state") in LIVE_STATES:
                return hint, info
        urls = list(dict.fromkeys([r["url"] for r in await self._replicas(client, 0.5 if fresh else 2.0)]
                                  + ([hint] if hint else []) + self.promoter.standbys()))
        answers = await asyncio.gather(*(self._ask(client, u, sid, auth) for u in urls))
        found = [(u, a) for u, a in zip(urls, answers, strict=True) if a is not None]
        if not found:
            return None
        url, info = min(found, key=lambda f: (_PREFERENCE.get(f[1].get("state"), 9), -len(f[1].get("token_ids") or [])))
        if info.get("state") in LIVE_STATES:
            self.seen(sid, url)
        return url, info

    async def _ask(self, client: httpx.AsyncClient, url: str, sid: str, auth: str | None) -> dict | None:
        try:
            r = await client.get(f"{url}/v1/sessions/{sid}", headers=self.headers(auth), timeout=5)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None  # a dead or unreachable replica has nothing to say


class SessionStream:
    """One client's stream of one session: upstream SSE events across moves, checkpoints and replica
    deaths, ending after the final chunk (or with one error event). `url`/`sid`/`n` say where it is."""

    def __init__(self, ups: Upstreams, client: httpx.AsyncClient, url: str = "", sid: str = "", n: int = 0,
                 auth: str | None = None):
        self.ups, self.client, self.auth = ups, client, auth
        self.url, self.sid, self.n = url, sid, n  # n: generated tokens already passed on
        self.ids: list[int] = []  # their ids (the ones this stream passed on: all of them when it began at 0)
        self.ended = False  # the final chunk (or an error) was passed on

    async def events(self, first: httpx.Response | None) -> AsyncIterator[dict]:
        """From `first` (an open upstream stream; None: find the session and reattach at `n`)."""
        resp = first
        why = "it is not running on any replica"
        for _ in range(MAX_HOPS + 1):
            if resp is None:
                resp = await self._reattach(why)
                if resp is None:
                    self.ended = True
                    yield self._lost_error(why)
                    return
            outcome = "lost"  # unless the stream says otherwise: the replica died or was cut off
            try:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        outcome = "done" if outcome == "lost" else outcome
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        if ev["error"].get("type") == "engine_unavailable":
                            break  # the replica's engine died: the session may come back elsewhere
                        self.ended = True
                        yield ev
                        return
                    self.sid = ev.get("id", self.sid)
                    if any(c.get("finish_reason") == "checkpointed" for c in ev.get("choices", [])):
                        outcome = "checkpointed"  # not the client's end: it continues where it is restored
                        continue
                    for c in ev.get("choices", []):
                        self.n += len(c.get("token_ids") or [])
                        self.ids += c.get("token_ids") or []
                    yield ev
                else:
                    if outcome == "lost":
                        outcome = "moved"  # ended without [DONE]: migrated (or the replica went away)
            except httpx.HTTPError:
                outcome = "lost"
            except (ValueError, httpx.StreamError, OSError) as e:  # a cut mid-event, a stream closed under us
                log.warning("session %s: upstream stream broke: %r", self.sid, e)
                outcome = "lost"
            finally:
                with contextlib.suppress(Exception):  # closing a broken connection must not end the client's stream
                    await resp.aclose()
            if outcome == "done":
                self.ended = True
                return
            if not self.sid:
                self.ended = True
                yield {"error": {"message": "upstream stream ended before its first event", "type": "upstream_error",
                                 "code": 502}}
                return
            if outcome == "lost":  # the replica died: its standby (if it has one) may promote the session
                self.ups.promoter.replica_lost(self.client, self.ups.headers(), self.url, self.sid,
                                               self.ids if len(self.ids) == self.n else None)
            why = {"checkpointed": "it was checkpointed with stop", "moved": "it left its replica",
                   "lost": "its replica stopped answering"}[outcome]
            resp = None
        self.ended = True
        yield {"error": {"message": f"session {self.sid} moved more than {MAX_HOPS} times", "type": "upstream_error",
                         "code": 502}}

    async def _reattach(self, why: str) -> httpx.Response | None:
        """Hold until the session runs (or has finished) somewhere, then open its stream at `n`."""
        deadline = time.monotonic() + reattach_wait_s()
        delay = 0.1
        while True:
            try:
                found = await self.ups.locate(self.client, self.sid, self.auth, fresh=True)
            except Exception:  # noqa: BLE001 - a lookup that failed in an unforeseen way: look again
                log.exception("session %s: looking for it failed", self.sid)
                found = None
            if found is not None:
                url, info = found
                if info.get("state") == "migrated" and info.get("migrated_to"):  # e.g. a target not listed
                    url, info = info["migrated_to"].rstrip("/"), {"state": "running"}
                if info.get("state") in LIVE_STATES:
                    resp = await self._open(url)
                    if resp is not None:
                        return resp
            if time.monotonic() + delay > deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    async def _open(self, url: str) -> httpx.Response | None:
        req = self.client.build_request("GET", f"{url}/v1/sessions/{self.sid}/stream",
                                        params={"from_token": self.n, "return_token_ids": "true"},
                                        headers=self.ups.headers(self.auth))
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            await resp.aclose()
            return None
        self.url = url
        self.ups.seen(self.sid, url)
        return resp

    def _lost_error(self, why: str) -> dict:
        wait = reattach_wait_s()
        return {"error": {"message": f"session {self.sid or '?'} did not come back within {wait:g}s ({why}); "
                                     f"reattach later with GET /v1/sessions/{self.sid}/stream?from_token={self.n}",
                          "type": "upstream_error", "code": 504}}

    def hang_up(self) -> None:
        """The client went away through this (live) gateway: tell the replica to abort the session now."""
        if self.ended or not self.sid or not self.url:
            return
        task = asyncio.get_running_loop().create_task(self._abort(self.url, self.sid))
        _PENDING_ABORTS.add(task)  # held until done: an unreferenced task may be collected mid-flight
        task.add_done_callback(_PENDING_ABORTS.discard)

    async def _abort(self, url: str, sid: str) -> None:
        try:
            await self.client.post(f"{url}/v1/sessions/{sid}/abort", headers=self.ups.headers(self.auth), timeout=10)
        except httpx.HTTPError:
            pass  # the replica is gone: its detach grace frees the session


# ---- relaying one request ----------------------------------------------------------------------
async def open_upstream(ups: Upstreams, client: httpx.AsyncClient, path: str, body: dict,
                        auth: str | None) -> tuple[SessionStream, AsyncIterator[dict]] | JSONResponse:
    """POST a completion (`path`) to the least busy replica: its SessionStream and events (counted as
    in flight on that replica until they end), or the error response to give the client."""
    try:
        url = await ups.pick(client)
    except LookupError as e:
        return error_response(503, str(e), "unavailable")
    # counted from the pick on: concurrent requests must see each other before the first token arrives
    ups.active[url] = ups.active.get(url, 0) + 1
    try:
        first = await client.send(client.build_request("POST", f"{url}{path}", json=body, headers=ups.headers(auth)),
                                  stream=True)
    except httpx.HTTPError as e:
        ups.active[url] -= 1
        return error_response(502, f"replica {url} did not answer: {type(e).__name__}", "upstream_error")
    except BaseException:
        ups.active[url] -= 1
        raise
    if first.status_code >= 400:
        ups.active[url] -= 1
        await first.aread()
        await first.aclose()
        try:
            return JSONResponse(first.json(), status_code=first.status_code)
        except ValueError:
            return error_response(first.status_code, first.text[:500], "upstream_error")
    stream = SessionStream(ups, client, url=url, auth=auth)

    async def events() -> AsyncIterator[dict]:
        try:
            async for ev in stream.events(first):
                yield ev
        except Exception as e:  # a fault of the gateway's own: the client gets an error event, not a cut stream
            log.exception("session %s: the gateway's stream failed", stream.sid)
            stream.ended = True
            yield {"error": {"message": f"the gateway's stream of session {stream.sid or '?'} failed: "
                                        f"{type(e).__name__}: {e}", "type": "upstream_error", "code": 502}}
        finally:
            ups.active[url] -= 1

    return stream, events()


def relay_sse(stream: SessionStream, events: AsyncIterator[dict], body: dict, want_ids: bool) -> SSEResponse:
    """The client's SSE stream; a client that hangs up before the end aborts its session (the replica is told)."""
    async def sse() -> AsyncIterator[bytes]:
        try:
            async for ev in events:
                if unwanted_usage(ev, body):
                    continue
                if not want_ids:
                    for c in ev.get("choices", []):
                        c.pop("token_ids", None)
                yield f"data: {json.dumps(ev)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            stream.hang_up()  # a no-op once the stream ended

    return streaming_response(sse())


def unwanted_usage(ev: dict, body: dict) -> bool:
    """The usage chunk (always asked for upstream) of a stream whose client did not ask for it."""
    return "usage" in ev and not ev.get("choices") and not (body.get("stream_options") or {}).get("include_usage")


async def unless_client_leaves(request: Request, stream: SessionStream, answer: Awaitable[T]) -> T | None:
    """Assemble a non-streamed answer while watching the client's connection: a client that hangs up
    first aborts its session, as a streamed one does (the replica is told); None then."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":  # the body was read already
            pass

    job, watch = asyncio.ensure_future(answer), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not job.done():  # the client left (or this handler was cancelled): stop reading upstream
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
            stream.hang_up()
    return job.result() if not job.cancelled() else None


@dataclass
class Gateway:
    """What the gateway's routes act on (the app's `state.gateway`): its replicas and its one client."""

    ups: Upstreams
    client: httpx.AsyncClient


async def gateway(request: Request) -> Gateway:
    # async: FastAPI runs a plain-def dependency on its thread pool, a thread hop per request
    return request.app.state.gateway


Collect = Callable[[AsyncIterator[dict], dict, bool], Awaitable[Any]]


async def forward(request: Request, g: Gateway, path: str, collect: Collect) -> Any:
    """A client's completion (`path`: /v1/completions or /v1/chat/completions), asked of a replica as a
    stream with token ids: relayed as it comes when the client streams, else folded into one answer
    by `collect`. Either way the session is followed wherever it moves."""
    body = await json_object(request)
    want_stream = bool(body.get("stream"))
    want_ids = bool(body.get("return_token_ids"))
    # include_usage: passed on to the client only if it asked
    up = {**body, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    opened = await open_upstream(g.ups, g.client, path, up, request.headers.get("authorization"))
    if isinstance(opened, JSONResponse):
        return opened
    stream, events = opened
    if want_stream:
        return relay_sse(stream, events, body, want_ids)
    answer = await unless_client_leaves(request, stream, collect(events, body, want_ids))
    return answer if answer is not None else Response(status_code=499)  # nobody reads it
