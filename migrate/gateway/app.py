"""The clients' OpenAI front door in front of replicas (docs/gateway.md): `/v1/completions`,
`/v1/chat/completions`, `/v1/models`, and `GET /v1/sessions/{id}[/stream]` for any session of any
replica of its agents.

Every request is streamed from a replica with token ids; when the session leaves its replica
(migrated, checkpointed with stop, or the replica died) the gateway holds the stream, finds where
it runs again and reattaches at the next token (migrate.gateway.sessions), so the client sees one
unbroken stream: no token lost, repeated or changed. The gateway keeps no state a restart would
lose: a client reattaches on any gateway with `GET /v1/sessions/{id}/stream?from_token=K`.
"""

from __future__ import annotations

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from relayout.engine.tracing import async_inject_hooks, install_tracing, setup_tracing
from relayout.engine.web import (
    ClientKeyAuth,
    HTTPError,
    check_id,
    env_api_keys,
    env_token,
    error_response,
    install_error_handlers,
    json_object,
    tls_context,
)
from relayout.migrate.gateway.chat import collect_completion, install_chat_gateway_route
from relayout.migrate.gateway.sessions import (
    SessionStream,
    Upstreams,
    open_upstream,
    relay_sse,
    unless_client_leaves,
)


def gateway_client_route(method: str, path: str) -> bool:
    """Every /v1 route of the gateway is a client route (client keys, when configured)."""
    return path.startswith("/v1/")


def create_gateway_app(agents: list[str], replicas: list[str] | None = None, token: str | None = None,
                       api_keys: list[str] | None = None) -> FastAPI:
    """`token`: the agents'/replicas' bearer token (default RELAYOUT_TOKEN); `api_keys`: the clients'
    keys (default RELAYOUT_API_KEYS; none: open)."""
    ups = Upstreams(agents, replicas or [], token if token is not None else env_token())
    app = FastAPI(title="relayout gateway")
    install_error_handlers(app)
    install_tracing(app)  # traces (when OTEL_* configure them) continue into the replicas: traceparent
    keys = env_api_keys() if api_keys is None else api_keys
    app.add_middleware(ClientKeyAuth, keys=keys, protects=gateway_client_route)
    client = httpx.AsyncClient(verify=tls_context(), timeout=httpx.Timeout(600, connect=10), event_hooks=async_inject_hooks())

    @app.get("/health")
    async def health():
        return {"status": "ok", "replicas": await ups.candidates(client)}

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            url = await ups.pick(client)
            r = await client.get(f"{url}/v1/models", headers=ups.headers(request.headers.get("authorization")))
        except LookupError as e:
            return error_response(503, str(e), "unavailable")
        except httpx.HTTPError as e:
            return error_response(502, f"replica did not answer: {type(e).__name__}", "upstream_error")
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.get("/v1/sessions/{sid}")
    async def session(sid: str, request: Request):
        """The session as the replica that has it says (running, else finished, checkpointed, migrated)."""
        found = await ups.locate(client, check_id(sid, "session", 404), request.headers.get("authorization"))
        if found is None:
            raise HTTPError(404, f"no session {sid!r} on any replica", "not_found_error")
        url, info = found
        return JSONResponse({**info, "replica": url})  # (not jsonable_encoder: see the replica's route)

    @app.get("/v1/sessions/{sid}/stream")
    async def session_stream(sid: str, request: Request, from_token: int = 0, return_token_ids: bool = False):
        """Reattach: the session's stream from generated token `from_token`, wherever it runs (held while
        it is checkpointed, moving or failing over, as a live stream is)."""
        if from_token < 0:
            raise HTTPError(400, "from_token must be >= 0")
        auth = request.headers.get("authorization")
        if await ups.locate(client, check_id(sid, "session", 404), auth) is None:
            raise HTTPError(404, f"no session {sid!r} on any replica", "not_found_error")
        stream = SessionStream(ups, client, sid=sid, n=from_token, auth=auth)
        return relay_sse(stream, stream.events(None), {"stream_options": {"include_usage": True}}, return_token_ids)

    install_chat_gateway_route(app, ups, client)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_object(request)
        want_stream = bool(body.get("stream"))
        want_ids = bool(body.get("return_token_ids"))
        up = {**body, "stream": True, "return_token_ids": True}
        up["stream_options"] = {"include_usage": True}  # passed on to the client only if it asked
        opened = await open_upstream(ups, client, "/v1/completions", up, request.headers.get("authorization"))
        if isinstance(opened, JSONResponse):
            return opened
        stream, events = opened
        if want_stream:
            return relay_sse(stream, events, body, want_ids)
        answer = await unless_client_leaves(request, stream, collect_completion(events, body, want_ids))
        return answer if answer is not None else Response(status_code=499)  # nobody reads it

    @app.on_event("shutdown")
    async def _close():
        await client.aclose()

    return app


def run_gateway(agents: list[str], replicas: list[str], host: str, port: int,
                api_keys: list[str] | None = None) -> None:
    import uvicorn

    setup_tracing("relayout-gateway")
    app = create_gateway_app(agents, replicas, api_keys=api_keys or None)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else port
                print(f"relayout gateway on http://{host}:{bound}", flush=True)

    _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)).run()


def main(argv: list[str] | None = None) -> None:
    """`python -m relayout.migrate.gateway.app`: the flags of `relayout gateway`."""
    from relayout.engine.command import run_as_main
    from relayout.migrate.gateway.cli import gateway_command

    run_as_main(gateway_command, "python -m relayout.migrate.gateway.app", argv)


if __name__ == "__main__":
    main()
