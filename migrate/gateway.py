"""The clients' `/v1/completions` in front of replicas (docs/gateway.md).

Every request is streamed from a replica with token ids; when the replica's stream ends
because the session was migrated (no `[DONE]`), the gateway asks where it went and
reattaches at the next token (`/v1/sessions/{id}/stream?from_token=K`), so the client sees
one unbroken stream: no token lost, repeated or changed, no error.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from relayout.engine.tracing import async_inject_hooks, install_tracing, setup_tracing
from relayout.engine.web import bearer_headers, env_token, error_response, install_error_handlers

MAX_HOPS = 16


class Upstreams:
    """Replica URLs, from agents (`GET /v1/replicas`) and/or given directly."""

    def __init__(self, agents: list[str], replicas: list[str], token: str | None):
        self.agents = [a.rstrip("/") for a in agents]
        self.static = [r.rstrip("/") for r in replicas]
        self.token = token
        self.active: dict[str, int] = {}
        self._cache: tuple[float, list[str]] = (0.0, [])

    def headers(self) -> dict[str, str]:
        return bearer_headers(self.token)

    async def candidates(self, client: httpx.AsyncClient) -> list[str]:
        if not self.agents:
            return list(self.static)
        at, cached = self._cache
        if time.monotonic() - at < 2.0 and cached:
            return cached
        urls = list(self.static)
        for a in self.agents:
            try:
                r = await client.get(f"{a}/v1/replicas", headers=self.headers(), timeout=5)
                body = r.json()
                items = body if isinstance(body, list) else body.get("replicas", [])
                for rep in items:
                    if rep.get("status", "running") == "running" and not rep.get("draining") and rep.get("url"):
                        urls.append(rep["url"].rstrip("/"))
            except (httpx.HTTPError, ValueError):
                continue  # an unreachable agent's replicas are not offered
        self._cache = (time.monotonic(), urls)
        return urls

    async def pick(self, client: httpx.AsyncClient) -> str:
        urls = await self.candidates(client)
        if not urls:
            raise LookupError("no replica is available")
        return min(urls, key=lambda u: (self.active.get(u, 0), urls.index(u)))


def create_gateway_app(agents: list[str], replicas: list[str] | None = None, token: str | None = None) -> FastAPI:
    ups = Upstreams(agents, replicas or [], token if token is not None else env_token())
    app = FastAPI(title="relayout gateway")
    install_error_handlers(app)
    install_tracing(app)  # traces (when OTEL_* configure them) continue into the replicas: traceparent
    client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), event_hooks=async_inject_hooks())

    @app.get("/health")
    async def health():
        return {"status": "ok", "replicas": await ups.candidates(client)}

    @app.get("/v1/models")
    async def models():
        try:
            url = await ups.pick(client)
        except LookupError as e:
            return error_response(503, str(e), "unavailable")
        r = await client.get(f"{url}/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    async def follow(url: str, first: httpx.Response) -> AsyncIterator[dict]:
        """Upstream SSE events of one session across migrations; ends after the final chunk."""
        resp: httpx.Response | None = first
        n = 0
        sid = ""
        for _ in range(MAX_HOPS):
            assert resp is not None
            done = False
            try:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        yield ev
                        return
                    sid = ev.get("id", sid)
                    for c in ev.get("choices", []):
                        n += len(c.get("token_ids") or [])
                    yield ev
            finally:
                await resp.aclose()
            if done:
                return
            if not sid:
                yield {"error": {"message": "upstream stream ended before its first event", "type": "upstream_error"}}
                return
            # the stream ended without [DONE]: the session moved; find it and reattach at token n
            info = (await client.get(f"{url}/v1/sessions/{sid}", headers=ups.headers())).json()
            nxt = info.get("migrated_to")
            if info.get("state") != "migrated" or not nxt:
                yield {"error": {"message": f"session {sid} stream ended unexpectedly", "type": "upstream_error"}}
                return
            url = nxt.rstrip("/")
            req = client.build_request("GET", f"{url}/v1/sessions/{sid}/stream",
                                       params={"from_token": n, "return_token_ids": "true"}, headers=ups.headers())
            resp = await client.send(req, stream=True)
        yield {"error": {"message": f"session {sid} moved more than {MAX_HOPS} times", "type": "upstream_error"}}

    from relayout.migrate.gateway_chat import (
        install_chat_gateway_route,
        join_completion_logprobs,
        unwanted_usage,
    )

    install_chat_gateway_route(app, ups, client, follow)  # chat streams reattach the same way

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        want_stream = bool(body.get("stream"))
        want_ids = bool(body.get("return_token_ids"))
        up = {**body, "stream": True, "return_token_ids": True}
        up["stream_options"] = {"include_usage": True}  # passed on to the client only if it asked
        try:
            url = await ups.pick(client)
        except LookupError as e:
            return error_response(503, str(e), "unavailable")
        # counted from the pick on: concurrent requests must see each other before the first token arrives
        ups.active[url] = ups.active.get(url, 0) + 1
        req = client.build_request("POST", f"{url}/v1/completions", json=up)
        try:
            first = await client.send(req, stream=True)
        except BaseException:
            ups.active[url] -= 1
            raise
        if first.status_code >= 400:
            ups.active[url] -= 1
            await first.aread()
            await first.aclose()
            return JSONResponse(first.json(), status_code=first.status_code)

        async def events() -> AsyncIterator[dict]:
            try:
                async for ev in follow(url, first):
                    yield ev
            finally:
                ups.active[url] -= 1

        if want_stream:
            async def sse() -> AsyncIterator[bytes]:
                async for ev in events():
                    if unwanted_usage(ev, body):
                        continue
                    if not want_ids:
                        for c in ev.get("choices", []):
                            c.pop("token_ids", None)
                    yield f"data: {json.dumps(ev)}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        text, ids, finish, sid, created, model = [], [], None, None, int(time.time()), body.get("model")
        logprobs, usage = None, {"completion_tokens": 0}
        async for ev in events():
            if "error" in ev:
                return error_response(502, ev["error"].get("message", "upstream error"), "upstream_error")
            sid = ev.get("id", sid)
            model = ev.get("model", model)
            usage = ev.get("usage") or usage
            for c in ev.get("choices", []):
                text.append(c.get("text", ""))
                ids += c.get("token_ids") or []
                finish = c.get("finish_reason") or finish
                logprobs = join_completion_logprobs(logprobs, c.get("logprobs"))
        choice = {"index": 0, "text": "".join(text), "logprobs": logprobs, "finish_reason": finish}
        if want_ids:
            choice["token_ids"] = ids
        return {"id": sid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
                "usage": usage}

    @app.on_event("shutdown")
    async def _close():
        await client.aclose()

    return app


def run_gateway(agents: list[str], replicas: list[str], host: str, port: int) -> None:
    import uvicorn

    setup_tracing("relayout-gateway")
    app = create_gateway_app(agents, replicas)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else port
                print(f"relayout gateway on http://{host}:{bound}", flush=True)

    _Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()


def main(argv: list[str] | None = None) -> None:
    """`python -m relayout.migrate.gateway`: the same flags as `relayout gateway`."""
    import argparse

    ap = argparse.ArgumentParser(prog="relayout gateway", description=__doc__.split("\n\n")[0])
    ap.add_argument("--agent", action="append", default=[], help="agent URL whose replicas to serve (repeatable)")
    ap.add_argument("--replica", action="append", default=[], help="a replica URL to serve directly (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args(argv)
    if not a.agent and not a.replica:
        ap.error("give at least one --agent or --replica")
    run_gateway(a.agent, a.replica, a.host, a.port)


if __name__ == "__main__":
    main()
