"""The replica's OpenAI-compatible HTTP API (SPEC §3) on top of an AsyncEngine."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from relayout.engine.async_engine import AsyncEngine, EngineDeadError
from relayout.engine.engine import RequestError
from relayout.engine.session import SamplingParams
from relayout.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from starlette.exceptions import HTTPException as StarletteHTTPException

if TYPE_CHECKING:
    from relayout.engine.workers import RankPlacement

MAX_COMPLETION_BODY = 8 << 20  # a 32k-token prompt as token ids is well under 1 MiB

_LIVE = {"waiting": "running", "running": "running", "paused": "running"}  # SPEC §3 names


# ---- errors ---------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_


def error_response(status: int, message: str, type_: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": status}}, status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            return f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}"
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request"


# ---- request ------------------------------------------------------------------------------
class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float | None = None  # OpenAI default: 1.0
    top_p: float | None = None
    top_k: int | None = None  # extension; -1 or 0 = no cut
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False  # extension: token_ids on each choice / chunk
    ignore_eos: bool = False  # extension
    n: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    user: str | None = Field(default=None)

    def prompt_ids(self, tok: Tokenizer) -> list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "only one prompt per request is supported (got a batch of prompts)")
            p = p[0]
        return tok.encode(p) if isinstance(p, str) else list(p)

    def sampling(self) -> SamplingParams:
        if self.n not in (None, 1) or self.best_of not in (None, 1):
            raise APIError(400, "n and best_of must be 1")
        if self.echo:
            raise APIError(400, "echo is not supported")
        if self.logprobs:
            raise APIError(400, "logprobs is not supported")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {self.max_tokens}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=16 if self.max_tokens is None else self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if not self.top_k or self.top_k < 0 else self.top_k,
            seed=self.seed,
            stop=[s for s in stop if s],
            ignore_eos=self.ignore_eos,
        )


# ---- text -------------------------------------------------------------------------------------
class StopTextStream:
    """Incremental text for one choice. Text that might be the start of a stop string is held
    back until it is known not to be; a stop string and everything after it is never emitted.
    Depends only on the token ids, so a resumed stream rebuilds it by replaying the ids."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.pending = ""
        self.stopped = False

    def add(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.pending += self.detok.add_many(ids)
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self.pending += self.detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self.pending
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.pending, self.stopped = "", True
            return text[: min(hits)]
        keep = 0
        if not final:
            for s in self.stop:  # longest suffix of text that is a proper prefix of a stop string
                for k in range(min(len(s) - 1, len(text)), keep, -1):
                    if text.endswith(s[:k]):
                        keep = k
                        break
        self.pending = text[len(text) - keep:]
        return text[: len(text) - keep]


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


# ---- metrics ---------------------------------------------------------------------------------------
class _Snapshot:
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
def create_app(aengine: AsyncEngine, model_name: str) -> FastAPI:
    eng = aengine.engine  # read-only facts (tokenizer, config, layout): never its mutable state
    tok = eng.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            await aengine.stop()

    app = FastAPI(title="relayout replica", lifespan=lifespan)

    @app.middleware("http")
    async def _body_limit(request: Request, call_next):
        # a completion body is a prompt and a few fields: refuse megabytes before parsing them
        cl = request.headers.get("content-length")
        if request.url.path == "/v1/completions" and cl and cl.isdigit() and int(cl) > MAX_COMPLETION_BODY:
            return error_response(413, f"request body over {MAX_COMPLETION_BODY} bytes", "invalid_request_error")
        return await call_next(request)
    from relayout.engine.session_routes import install_session_routes

    install_session_routes(app, aengine)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.type)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError):
        return error_response(400, str(e), "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        return error_response(400, _validation_message(e), "invalid_request_error")

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError):
        return error_response(503, str(e), "engine_unavailable")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

    def require_healthy() -> None:
        if not aengine.healthy:
            raise EngineDeadError(str(aengine._dead()))

    def snapshot(sid: str) -> dict:
        snap = aengine.get(sid)
        if snap is None:
            raise APIError(404, f"no session {sid!r} on this replica", "not_found_error")
        return snap

    # ---- routes --------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not aengine.healthy:
            return error_response(503, str(aengine._dead()), "engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        stats = None
        if aengine.healthy:
            try:
                stats = await aengine.call(lambda e: e.expert_stats())
            except EngineDeadError:
                pass
        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Snapshot(aengine, stats, eng.num_blocks))
        return PlainTextResponse(generate_latest(reg).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "relayout",
                                            "max_model_len": eng.max_model_len}]}

    @app.get("/v1/replica")
    async def replica():
        require_healthy()

        def gather(e):
            st = e.expert_stats()
            return {
                "model": model_name,
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
            }

        return await aengine.call(gather)

    @app.get("/v1/sessions/{sid}")
    async def session(sid: str):
        s = snapshot(sid)
        out = {**s, "state": _LIVE.get(s["state"], s["state"])}
        if sid in aengine.migrated_to:
            out["migrated_to"] = aengine.migrated_to[sid]
        return out

    @app.get("/v1/sessions/{sid}/stream")
    async def session_stream(sid: str, request: Request, from_token: int = 0, return_token_ids: bool = False):
        s = snapshot(sid)
        if from_token < 0:
            raise APIError(400, "from_token must be >= 0")
        stop = await _stop_of(sid)
        return _streaming(request, sid, from_token, stop, return_token_ids, include_usage=False,
                          prompt_len=len(s["prompt_token_ids"]))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        require_healthy()
        params = req.sampling()
        ids = req.prompt_ids(tok)
        s = await aengine.submit(ids, params)
        sid = s.session_id
        stops[sid] = params.stop
        if len(stops) > 8192:  # bounded: only needed while a session can still be streamed
            for k in list(stops)[:1024]:
                del stops[k]
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return _streaming(request, sid, 0, params.stop, req.return_token_ids, include_usage, len(ids))
        watcher = asyncio.create_task(_abort_on_disconnect(request, sid))
        try:
            out: list[int] = []
            async for batch in aengine.stream(sid):
                out += batch
        finally:
            watcher.cancel()
        snap = aengine.get(sid) or {}
        if snap.get("state") == "migrated":
            raise APIError(409, f"session {sid} was migrated to another replica mid-request; reattach with "
                           f"GET /v1/sessions/{sid}/stream there", "session_migrated")
        ts = StopTextStream(tok, params.stop)
        text = ts.add(out) + ts.finish()
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": snap.get("finish_reason")}
        if req.return_token_ids:
            choice["token_ids"] = out
        return {"id": sid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [choice], "usage": _usage(len(ids), len(out))}

    stops: dict[str, list[str]] = {}  # session id -> stop strings (for resumed streams' text)

    async def _stop_of(sid: str) -> list[str]:
        if sid in stops:
            return stops[sid]
        # a session this server did not admit (restored / migrated in): ask the engine
        def find(e):
            s = e.sessions.get(sid)
            return list(s.sampling.stop) if s is not None else []
        try:
            return await aengine.call(find)
        except EngineDeadError:
            return []

    async def _abort_on_disconnect(request: Request, sid: str) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)
        aengine.abort(sid)

    def _streaming(request: Request, sid: str, from_token: int, stop: list[str], with_ids: bool,
                   include_usage: bool, prompt_len: int) -> StreamingResponse:
        return _SSEResponse(_sse_stream(request, sid, from_token, stop, with_ids, include_usage, prompt_len),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _sse_stream(request: Request, sid: str, from_token: int, stop: list[str], with_ids: bool,
                          include_usage: bool, prompt_len: int) -> AsyncIterator[bytes]:
        created = int(time.time())
        ts = StopTextStream(tok, stop)

        def chunk(text: str, ids: list[int], finish: str | None) -> bytes:
            c: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if with_ids:
                c["token_ids"] = ids
            return _sse({"id": sid, "object": "text_completion", "created": created, "model": model_name,
                         "choices": [c]})

        complete = False
        n = 0
        # notices a disconnect even while no token flows (e.g. the session is paused)
        watcher = asyncio.create_task(_abort_on_disconnect(request, sid))
        try:
            try:
                # from token 0: ids before from_token (already sent) only rebuild the text state
                async for batch in aengine.stream(sid):
                    skip = max(0, min(len(batch), from_token - n))
                    n += len(batch)
                    ts.add(batch[:skip])
                    if skip == len(batch):
                        continue
                    text = ts.add(batch[skip:])
                    if text or with_ids:
                        yield chunk(text, batch[skip:], None)
            except EngineDeadError as e:
                complete = True  # nothing left to abort
                yield _sse({"error": {"message": str(e), "type": "engine_unavailable", "code": 503}})
                return
            snap = aengine.get(sid) or {}
            complete = True
            if snap.get("state") == "migrated":
                return  # no [DONE]: the session continues elsewhere (reattach with /stream there)
            yield chunk(ts.finish(), [], snap.get("finish_reason"))
            if include_usage:
                yield _sse({"id": sid, "object": "text_completion", "created": created, "model": model_name,
                            "choices": [], "usage": _usage(prompt_len, n)})
            yield _sse("[DONE]")
        finally:
            watcher.cancel()
            if not complete:  # client went away mid-stream: free the session (a migrated one is a no-op)
                aengine.abort(sid)

    return app


class _SSEResponse(StreamingResponse):
    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:  # a failed send (client gone) must still run the generator's cleanup, now
            await self.body_iterator.aclose()


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---- serve -------------------------------------------------------------------------------------------
def serve(model: str = "builtin:tiny", layout: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          kv_cache_mb: int | None = None, device: str | None = None, placement: RankPlacement | None = None,
          dtype: str | None = None, kv_dtype: str | None = None) -> None:
    """Load the model, serve it until SIGTERM/SIGINT, then shut the engine (and its ranks) down."""
    import uvicorn
    from relayout.engine.engine import LLMEngine

    # uvicorn re-raises the signal it caught once it has shut down; make that a clean exit 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engine = LLMEngine(model, layout, kv_cache_bytes=kv_cache_mb * 2**20 if kv_cache_mb else None, device=device,
                       placement=placement, dtype=dtype, kv_dtype=kv_dtype)
    aengine = AsyncEngine(engine)
    try:
        app = create_app(aengine, model)

        class _Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started:
                    bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else port
                    print(f"relayout serving {model} on http://{host}:{bound}", flush=True)

            async def shutdown(self, sockets=None):
                await aengine.stop()  # end open streams first, so their connections can close
                await super().shutdown(sockets)

        _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)).run()
    finally:
        aengine.stop_sync(timeout=10)
        if aengine._thread is None:  # never started: the loop thread did not shut the engine down
            engine.shutdown()
