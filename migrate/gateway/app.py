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

from contextlib import asynccontextmanager

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from relayout.engine.tracing import async_inject_hooks, install_tracing, setup_tracing
from relayout.engine.web import (
    ClientKeyAuth,
    HTTPError,
    check_id,
    env_api_keys,
    env_token,
    error_response,
    install_error_handlers,
    tls_context,
)
from relayout.migrate.gateway.chat import collect_completion
from relayout.migrate.gateway.chat import router as chat_router
from relayout.migrate.gateway.sessions import Gateway, SessionStream, Upstreams, forward, gateway, relay_sse


def gateway_client_route(method: str, path: str) -> bool:
    """Every /v1 route of the gateway is a client route (client keys, when configured)."""
    return path.startswith("/v1/")


router = APIRouter()  # the gateway's client routes (create_gateway_app includes it)


@router.get("/health")
async def health(g: Gateway = Depends(gateway)):
    return {"status": "ok", "replicas": await g.ups.candidates(g.client)}


@router.get("/v1/models")
async def models(request: Request, g: Gateway = Depends(gateway)):
    try:
        url = await g.ups.pick(g.client)
        r = await g.client.get(f"{url}/v1/models", headers=g.ups.headers(request.headers.get("authorization")))
    except LookupError as e:
        return error_response(503, str(e), "unavailable")
    except httpx.HTTPError as e:
        return error_response(502, f"replica did not answer: {type(e).__name__}", "upstream_error")
    return JSONResponse(r.json(), status_code=r.status_code)


@router.get("/v1/sessions/{sid}")
async def session(sid: str, request: Request, g: Gateway = Depends(gateway)):
    """The session as the replica that has it says (running, else finished, checkpointed, migrated)."""
    found = await g.ups.locate(g.client, check_id(sid, "session", 404), request.headers.get("authorization"))
    if found is None:
        raise HTTPError(404, f"no session {sid!r} on any replica", "not_found_error")
    url, info = found
    return JSONResponse({**info, "replica": url})  # (not jsonable_encoder: see the replica's route)


@router.get("/v1/sessions/{sid}/stream")
async def session_stream(sid: str, request: Request, from_token: int = 0, return_token_ids: bool = False,
                         g: Gateway = Depends(gateway)):
    """Reattach: the session's stream from generated token `from_token`, wherever it runs (held while
    it is checkpointed, moving or failing over, as a live stream is)."""
    if from_token < 0:
        raise HTTPError(400, "from_token must be >= 0")
    auth = request.headers.get("authorization")
    if await g.ups.locate(g.client, check_id(sid, "session", 404), auth) is None:
        raise HTTPError(404, f"no session {sid!r} on any replica", "not_found_error")
    stream = SessionStream(g.ups, g.client, sid=sid, n=from_token, auth=auth)
    return relay_sse(stream, stream.events(None), {"stream_options": {"include_usage": True}}, return_token_ids)


@router.post("/v1/completions")
async def completions(request: Request, g: Gateway = Depends(gateway)):
    return await forward(request, g, "/v1/completions", collect_completion)


def create_gateway_app(agents: list[str], replicas: list[str] | None = None, token: str | None = None,
                       api_keys: list[str] | None = None) -> FastAPI:
    """`token`: the agents'/replicas' bearer token (default RELAYOUT_TOKEN); `api_keys`: the clients'
    keys (default RELAYOUT_API_KEYS; none: open)."""
    ups = Upstreams(agents, replicas or [], token if token is not None else env_token())
    client = httpx.AsyncClient(verify=tls_context(), timeout=httpx.Timeout(600, connect=10), event_hooks=async_inject_hooks())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="relayout gateway", lifespan=lifespan)
    app.state.gateway = Gateway(ups, client)
    install_error_handlers(app)
    install_tracing(app)  # traces (when OTEL_* configure them) continue into the replicas: traceparent
    keys = env_api_keys() if api_keys is None else api_keys
    app.add_middleware(ClientKeyAuth, keys=keys, protects=gateway_client_route)
    app.include_router(router)
    app.include_router(chat_router)
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
