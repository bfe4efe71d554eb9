"""The replica's OpenAI-compatible HTTP API on top of an AsyncEngine (docs/replica-api.md).

Serving only: the routes that move sessions, and the `serve` command that composes a whole
replica, are migrate's (migrate.replica.routes, migrate.replica.serve)."""

from __future__ import annotations

import re
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from relayout.engine.api.chat import load_chat_template, shape_for
from relayout.engine.api.chat import router as chat_router
from relayout.engine.api.openai_request import OpenAIRequest
from relayout.engine.api.served import Served, served
from relayout.engine.api.streaming import (
    CompletionShape,
    StopTextStream,
    StreamSpec,
    admit,
    collect,
    session_events,
    spec_of,
    streaming_response,
)
from relayout.engine.api.streaming import usage as _usage
from relayout.engine.kv_cache import BLOCK_SIZE
from relayout.engine.model.tokenizer import Tokenizer
from relayout.engine.ranks.runner import kv_block_bytes
from relayout.engine.runtime.async_engine import AsyncEngine, EngineDeadError
from relayout.engine.runtime.engine import RequestError
from relayout.engine.runtime.logprobs import MAX_TOP_LOGPROBS, CompletionLogprobs
from relayout.engine.runtime.session import SamplingParams
from relayout.engine.web import (
    BodyLimit,
    BodyLimits,
    ClientKeyAuth,
    HTTPError,
    env_api_keys,
    env_token,
    error_response,
    install_error_handlers,
)

MAX_COMPLETION_BODY = 8 << 20  # a 32k-token prompt as token ids is well under 1 MiB
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
CLIENT_SESSION_PATH = re.compile(r"/v1/sessions/[A-Za-z0-9][A-Za-z0-9._-]{0,127}(/stream)?")
CLIENT_ABORT_PATH = re.compile(r"/v1/sessions/[A-Za-z0-9][A-Za-z0-9._-]{0,127}/abort")

_LIVE = {"waiting": "running", "running": "running", "paused": "running"}  # the replica API's names


# ---- request ------------------------------------------------------------------------------
class CompletionRequest(OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def prompt_ids(self, tok: Tokenizer) -> list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise HTTPError(400, "only one prompt per request is supported (got a batch of prompts)")
            p = p[0]
        return tok.encode(p) if isinstance(p, str) else list(p)

    def sampling(self) -> SamplingParams:
        if self.n not in (None, 1) or self.best_of not in (None, 1):
            raise HTTPError(400, "n and best_of must be 1")
        if self.echo:
            raise HTTPError(400, "echo is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise HTTPError(400, f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        try:
            return self.sampling_params(self.max_tokens, 16, self.logprobs)
        except RequestError as e:
            raise HTTPError(400, str(e)) from None


# ---- metrics ---------------------------------------------------------------------------------------
class _MetricsView:
    """A prometheus collector over figures gathered beforehand (on the engine thread)."""

    def __init__(self, aengine: AsyncEngine, stats: dict | None, num_blocks: int):
        self.a, self.stats, self.num_blocks = aengine, stats, num_blocks

    def collect(self):
        a = self.a
        c = CounterMetricFamily("relayout_tokens_generated", "Tokens generated")
        c.add_metric([], a.tokens_generated)
        yield c
        c = CounterMetricFamily("relayout_engine_steps", "Engine steps run")
        c.add_metric([], a.num_steps)
        yield c
        g = GaugeMetricFamily("relayout_running_sessions", "Sessions not finished (waiting, running or paused)")
        g.add_metric([], a.num_running)
        yield g
        g = GaugeMetricFamily("relayout_kv_blocks_used", "KV cache blocks in use")
        g.add_metric([], a.kv_blocks_used)
        yield g
        g = GaugeMetricFamily("relayout_kv_blocks_total", "KV cache blocks per attention-DP group")
        g.add_metric([], self.num_blocks)
        yield g
        g = GaugeMetricFamily("relayout_healthy", "1 while the engine loop is healthy")
        g.add_metric([], 1 if a.healthy else 0)
        yield g
        if self.stats is not None:
            c = CounterMetricFamily("relayout_expert_tokens", "Tokens routed to each logical expert",
                                    labels=["layer", "expert"])
            for layer, row in enumerate(self.stats["expert_counts"]):
                for e, n in enumerate(row):
                    c.add_metric([str(layer), str(e)], n)
            yield c
            c = CounterMetricFamily("relayout_a2a_bytes", "All-to-all bytes sent from one rank to another",
                                    labels=["src", "dst"])
            for src, row in enumerate(self.stats["a2a_bytes"]):
                for dst, n in enumerate(row):
                    c.add_metric([str(src), str(dst)], n)
            yield c
            c = CounterMetricFamily("relayout_a2a_seconds", "Expert exchange time per layer, exposed (ranks "
                                    "waited) or in flight (total)", labels=["layer", "kind"])
            for layer, (ex, tot) in enumerate(zip(self.stats["exposed_s"], self.stats["total_s"], strict=True)):
                c.add_metric([str(layer), "exposed"], ex)
                c.add_metric([str(layer), "total"], tot)
            yield c


# ---- app ------------------------------------------------------------------------------------------
def replica_client_route(method: str, path: str) -> bool:
    """The routes a client key opens on a replica (the session-moving ones need the replica token)."""
    if method == "GET":
        return path == "/v1/models" or CLIENT_SESSION_PATH.fullmatch(path) is not None
    return method == "POST" and (path in COMPLETION_PATHS or CLIENT_ABORT_PATH.fullmatch(path) is not None)


def replica_info(e, model_name: str) -> dict:
    """GET /v1/replica, on the engine thread: what the replica is and holds."""
    st = e.expert_stats()
    return {
        "model": model_name,
        **e.engine_info(),  # engine (builtin | vllm), engine_version, vLLM's own engine_url
        "layout": e.layout.to_dict(),
        "dtype": str(e.dtype).removeprefix("torch."),
        "kv_dtype": e.kv_dtype_name,
        "sessions": [{"id": sid, "state": s.status.value, "num_tokens": s.num_tokens}
                     for sid, s in e.sessions.items() if not s.is_finished],
        "expert_counts": st["expert_counts"],
        "a2a_bytes": st["a2a_bytes"],
        "a2a_exposed_s": st["exposed_s"],
        "a2a_total_s": st["total_s"],
        "kv_blocks_used": e.kv_blocks_used(),
        "num_blocks": e.num_blocks,
        # one token's KV across every layer and KV head, as a checkpoint or a move carries it
        "kv_bytes_per_token": kv_block_bytes(e.cfg, e.cfg.num_kv_heads, e.kv_dtype) // BLOCK_SIZE,
    }


async def completion_answer(aengine: AsyncEngine, request: Request, req: CompletionRequest, params: SamplingParams,
                            sid: str, model_name: str, prompt_len: int) -> dict:
    """A non-streamed completion's answer, once its session ended (409 if it moved away meanwhile)."""
    tok = aengine.engine.tokenizer
    out, records, snap = await collect(aengine, request, sid)  # 409 if it moved away meanwhile
    ts = StopTextStream(tok, params.stop)
    text = ts.add(out) + ts.finish()
    lp = CompletionLogprobs(tok).add(out, records) if params.logprobs is not None else None
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": lp, "finish_reason": snap.get("finish_reason")}
    if req.return_token_ids:
        choice["token_ids"] = out
    return {"id": sid, "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": [choice], "usage": _usage(prompt_len, len(out))}


def require_healthy(aengine: AsyncEngine) -> None:
    if not aengine.healthy:
        raise EngineDeadError(str(aengine.dead_error()))


def snapshot(aengine: AsyncEngine, sid: str, token_ids: bool = True) -> dict:
    snap = aengine.get(sid, token_ids)
    if snap is None:
        raise HTTPError(404, f"no session {sid!r} on this replica", "not_found_error")
    return snap


def session_view(aengine: AsyncEngine, sid: str, token_ids: bool) -> dict:
    """GET /v1/sessions/{id}: the session's state as clients see it, where it went if it left."""
    s = snapshot(aengine, sid, token_ids)
    out = {**s, "state": _LIVE.get(s["state"], s["state"])}
    if sid in aengine.migrated_to:
        out["migrated_to"] = aengine.migrated_to[sid]
    if out["state"] == "checkpointed" and sid in aengine.checkpointed_to:
        out["checkpoint"] = aengine.checkpointed_to[sid]
    return out


def install_guards(app: FastAPI, api_keys: list[str] | None) -> None:
    """Body limits, client keys and the error answers every replica route shares."""
    # a completion body is a prompt and a few fields: refuse megabytes before parsing them; the session
    # and protection routes bound their own paths in the same table (app.state.body_limits)
    app.state.body_limits = limits = BodyLimits()
    limits.bound(lambda path: path in COMPLETION_PATHS, MAX_COMPLETION_BODY)
    app.add_middleware(BodyLimit, limit=limits)
    install_error_handlers(app)
    keys = env_api_keys() if api_keys is None else api_keys
    app.add_middleware(ClientKeyAuth, keys=keys, protects=replica_client_route, token=env_token())

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError):
        return error_response(400, str(e), "invalid_request_error")

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError):
        return error_response(503, str(e), "engine_unavailable")


async def metrics_response(aengine: AsyncEngine) -> PlainTextResponse:
    """GET /metrics: Prometheus text, the engine's expert counts when it answers."""
    stats = None
    if aengine.healthy:
        try:
            stats = await aengine.call(lambda e: e.expert_stats())
        except EngineDeadError:
            pass
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_MetricsView(aengine, stats, aengine.engine.num_blocks))
    return PlainTextResponse(generate_latest(reg).decode(), media_type="text/plain; version=0.0.4")


router = APIRouter()  # the replica's OpenAI-compatible API and its sessions (create_app includes it)


@router.get("/health")
async def health(sv: Served = Depends(served)):
    if not sv.aengine.healthy:
        return error_response(503, str(sv.aengine.dead_error()), "engine_unavailable")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(sv: Served = Depends(served)):
    return await metrics_response(sv.aengine)


@router.get("/v1/models")
async def models(sv: Served = Depends(served)):
    return {"object": "list", "data": [{"id": sv.model_name, "object": "model", "created": 0, "owned_by": "relayout",
                                        "max_model_len": sv.max_model_len}]}


@router.get("/v1/replica")
async def replica(sv: Served = Depends(served)):
    require_healthy(sv.aengine)
    return await sv.aengine.call(lambda e: replica_info(e, sv.model_name))


@router.get("/v1/sessions/{sid}")
async def session(sid: str, token_ids: bool = True, sv: Served = Depends(served)):
    # plain JSON, not FastAPI's jsonable_encoder: it walks every id in Python (~20 ms for a 16k-token
    # session, on the process whose engine thread and links serve a migration's final round)
    return JSONResponse(session_view(sv.aengine, sid, token_ids))


@router.post("/v1/sessions/{sid}/abort")
async def session_abort(sid: str, sv: Served = Depends(served)):
    """What a live gateway sends when its client hangs up: free the session now (no detach grace)."""
    snapshot(sv.aengine, sid)
    sv.aengine.abort(sid)  # a finished, migrated or checkpointed session: a no-op
    return {"id": sid, "aborted": True}


@router.get("/v1/sessions/{sid}/stream")
async def session_stream(sid: str, request: Request, from_token: int = 0, return_token_ids: bool = False,
                         sv: Served = Depends(served)):
    s = snapshot(sv.aengine, sid)
    if from_token < 0:
        raise HTTPError(400, "from_token must be >= 0")
    spec = await spec_of(sv.aengine, sid)  # a chat session resumes as chat chunks
    return streaming_response(session_events(
        sv.aengine, request, sid, model=sv.model_name, created=int(time.time()), shape=shape_for(spec, sv.tok),
        spec=spec, from_token=from_token, with_ids=return_token_ids, prompt_len=len(s["prompt_token_ids"])))


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, sv: Served = Depends(served)):
    aengine, tok = sv.aengine, sv.tok
    require_healthy(aengine)
    params = req.sampling()
    ids = req.prompt_ids(tok)
    include_usage = bool(req.stream and (req.stream_options or {}).get("include_usage"))
    s = await admit(aengine, ids, params, "completion", include_usage)
    sid = s.session_id
    if req.stream:
        return streaming_response(session_events(
            aengine, request, sid, model=sv.model_name, created=int(time.time()),
            shape=CompletionShape(tok, params.logprobs is not None), spec=StreamSpec.of(s),
            from_token=0, with_ids=req.return_token_ids, prompt_len=len(ids)))
    return await completion_answer(aengine, request, req, params, sid, sv.model_name, len(ids))


def create_app(aengine: AsyncEngine, model_name: str, api_keys: list[str] | None = None) -> FastAPI:
    """`api_keys`: the client keys (default RELAYOUT_API_KEYS; none: the client routes are open)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            await aengine.stop()

    app = FastAPI(title="relayout replica", lifespan=lifespan)
    app.state.served = Served(aengine, model_name, load_chat_template(aengine.engine.model_dir))
    install_guards(app, api_keys)
    app.include_router(router)
    app.include_router(chat_router)
    return app
