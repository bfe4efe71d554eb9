"""A whole replica: engine.api.server's OpenAI API plus the routes that move sessions
(migrate.replica.routes), served until SIGTERM/SIGINT. `relayout serve` runs this; so does

    python -m relayout.migrate.replica.serve --model M --layout L --host H --port P [--kv-cache-mb N]
        [--device D] [--local-ranks 0,1] [--rank-endpoint HOST:PORT] [--api-key KEY ...]

Once listening it prints `relayout serving MODEL on http://HOST:PORT`."""

from __future__ import annotations

import signal
import sys
import threading

from fastapi import FastAPI
from relayout.engine.api.server import create_app
from relayout.engine.ranks.workers import RankPlacement
from relayout.engine.runtime.async_engine import AsyncEngine
from relayout.engine.tracing import install_tracing, setup_tracing
from relayout.engine.web import tls_context
from relayout.migrate.protection.routes import install_protect_routes
from relayout.migrate.replica.routes import install_replica_routes
from relayout.storage.format.chunks import one_malloc_arena
from relayout.storage.settings import settings


def create_replica_app(aengine: AsyncEngine, model_name: str, api_keys: list[str] | None = None) -> FastAPI:
    """The replica's app: serving, checkpoint/restore, live transfers and protection. `api_keys`: the
    client keys (default RELAYOUT_API_KEYS)."""
    app = create_app(aengine, model_name, api_keys)
    install_replica_routes(app, aengine)
    install_protect_routes(app, aengine)
    install_tracing(app)  # continues the migrator's trace (traceparent) in a span per request
    return app


def protect_from_start(app: FastAPI, aengine: AsyncEngine, standby: str, own_url: str) -> None:
    from relayout.engine.web import env_token
    from relayout.migrate.protection.replication import ProtectConfig
    from relayout.migrate.protection.routes import start_protection

    start_protection(app, aengine, ProtectConfig(standby.rstrip("/"), own_url), env_token())


def rank_placement(local_ranks: list[int] | None, rank_endpoint: str | None) -> RankPlacement | None:
    """Where the ranks run when some join from other hosts (None: all here). ValueError for a bad endpoint."""
    from relayout.engine.ranks.rank_channel import split_hostport

    if local_ranks is None and rank_endpoint is None:
        return None
    split_hostport(rank_endpoint or "127.0.0.1:0")
    return RankPlacement(local_ranks=local_ranks, endpoint=rank_endpoint or "127.0.0.1:0",
                         token=settings().token)


def serve(model: str = "builtin:tiny", layout: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          kv_cache_mb: int | None = None, device: str | None = None, placement: RankPlacement | None = None,
          dtype: str | None = None, kv_dtype: str | None = None, standby: str | None = None,
          api_keys: list[str] | None = None, engine_kind: str = "builtin", vllm_args: list[str] | None = None,
          attach: str | None = None, exchange: str | None = None) -> None:
    """Load the model, serve it until SIGTERM/SIGINT, then shut the engine (and its ranks) down.
    `standby`: a replica URL to protect this one's sessions to from the start (migrate.protection.replication).
    `engine_kind` "vllm": a stock vLLM server does the serving (engine.vllm.engine), `vllm_args` passed to it."""
    one_malloc_arena()  # before the engine starts threads: freed round buffers stay for the next round
    import uvicorn
    from relayout.engine.runtime.engine import LLMEngine

    # uvicorn re-raises the signal it caught once it has shut down; make that a clean exit 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    setup_tracing("relayout-replica")  # a no-op unless OTEL_* variables configure an exporter
    if engine_kind == "vllm":
        from relayout.engine.vllm.engine import VllmEngine

        if (kv_dtype or "auto") != "auto":
            raise ValueError("--kv-dtype: a vLLM replica's KV is of its model's dtype (--dtype); vLLM's --kv-cache-dtype is refused")
        if placement is not None:
            raise ValueError("--local-ranks/--rank-endpoint: vLLM places its own ranks")
        if attach is not None and vllm_args:
            raise ValueError("--vllm-args: an attached vLLM was started by you, with its own flags")
        engine = VllmEngine(model, layout, dtype=dtype, kv_cache_mb=kv_cache_mb, host=host, vllm_args=vllm_args,
                            attach=attach, exchange=exchange)
    else:
        engine = LLMEngine(model, layout, kv_cache_bytes=kv_cache_mb * 2**20 if kv_cache_mb else None,
                           device=device, placement=placement, dtype=dtype, kv_dtype=kv_dtype)
    aengine = AsyncEngine(engine)
    try:
        app = create_replica_app(aengine, model, api_keys)

        class _Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started:
                    # the one TLS context (the CA bundle: 40-80 ms of CPU) built now, beside serving: a
                    # first migration that is one cold round would otherwise build it inside its stall
                    threading.Thread(target=tls_context, name="tls-context", daemon=True).start()
                    bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else port
                    if standby:
                        protect_from_start(app, aengine, standby, f"http://{host}:{bound}")
                    print(f"relayout serving {model} on http://{host}:{bound}", flush=True)

            async def shutdown(self, sockets=None):
                await aengine.stop()  # end open streams first, so their connections can close
                await super().shutdown(sockets)

        _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)).run()
    finally:
        aengine.stop_sync(timeout=10)
        if not aengine.started:  # never started: the loop thread did not shut the engine down
            engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    from relayout.migrate.replica.serve_cli import (
        main as cli_main,  # the flags of `relayout serve`, defined once
    )

    cli_main(argv)


if __name__ == "__main__":
    main()
