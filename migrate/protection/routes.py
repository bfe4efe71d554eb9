"""The replica routes of protection (docs/replica-api.md): as a source, `POST/GET/DELETE
/v1/protection` starts, shows (each session's replication lag) and stops the continuous
replication of this replica's sessions to a standby; as a standby, `/v1/standby/{id}/...`
takes the rounds, shows the copies and promotes them. They need the replica's bearer token
when it has one (RELAYOUT_TOKEN)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field
from relayout.engine.runtime.async_engine import AsyncEngine
from relayout.engine.web import (
    MAX_JSON_BODY,
    URL_RE,
    HTTPError,
    bearer_auth,
    bearer_headers,
    check_id,
    env_token,
    error_response,
    tls_context,
)
from relayout.migrate.protection.replication import LEASE_S, ProtectConfig, Replicator, engine_progress
from relayout.migrate.protection.standby import PoolKeeper, ProtectionError, StandbyKeeper, StandbyTable
from relayout.migrate.protocol.engine_ops import engine_ops_for
from relayout.migrate.protocol.states import LIVE_PROTECTION
from relayout.storage.settings import settings


class ProtectBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    standby: str = Field(..., max_length=2048)  # the standby replica's URL
    every_tokens: int = Field(16, ge=1, le=1 << 20)
    every_ms: int = Field(200, ge=10, le=600_000)
    lease_s: float = Field(LEASE_S, ge=0.2, le=600)
    # this replica's URL as the standby reaches it (default: the URL this request came to)
    source_url: str | None = Field(None, max_length=2048)
    codec: str = Field("none", pattern="^(none|zstd|zstd-planes)$")


class PromoteBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # session -> every generated token id the caller saw (the gateway: every id it forwarded)
    tokens: dict[str, list[int]] = Field(default_factory=dict, max_length=4096)
    wait: bool = True  # wait for the lease to lapse (else 409 while it holds)


def standby_keeper(ops) -> StandbyKeeper:
    """Where this replica keeps a standby's copies: its KV pool (builtin), staged load files (vLLM)."""
    from relayout.migrate.protocol.vllm_ops import VllmOps

    if isinstance(ops, VllmOps):
        from relayout.migrate.protection.vllm_standby import StagedKeeper

        return StagedKeeper(ops)
    return PoolKeeper(ops.call)


def _current(app: FastAPI) -> Replicator:
    rep = app.state.protection
    if rep is None:
        raise HTTPError(404, "this replica's sessions are not protected", "not_found")
    return rep


def _url(u: str, what: str) -> str:
    if len(u) > 2048 or not URL_RE.fullmatch(u):
        raise HTTPError(400, f"{what} must be an http(s) URL")
    return u.rstrip("/")


def prepare_client() -> None:
    """Build what this process's first HTTP client needs: the TLS context (tls_context: 50-500 ms of
    CPU on a small host) and httpx's lazily imported transport. A standby's first client is the one
    that asks the source at promotion, on a failover's critical path: a thread does this as soon as
    the replica becomes a standby instead."""
    httpx.AsyncClient(verify=tls_context())


def source_answer(token: str | None):
    """How a standby asks a source about a protection (raises when the source does not answer)."""

    async def ask(source: str, pid: str) -> str | None:
        async with httpx.AsyncClient(verify=tls_context(), timeout=httpx.Timeout(1.0)) as c:
            r = await c.get(f"{source}/v1/protection/{pid}", headers=bearer_headers(token))
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise RuntimeError(f"source answered HTTP {r.status_code}")
        return r.json().get("state")

    return ask


def start_protection(app: FastAPI, aengine: AsyncEngine, cfg: ProtectConfig, token: str | None) -> Replicator:
    """Protect this replica's sessions to `cfg.standby` (on the server's event loop)."""
    rep = Replicator(Replicator.new_id(), cfg, engine_ops_for(aengine), engine_progress(aengine.engine),
                     lambda: aengine.recent_step_s, token)
    rep.start()
    app.state.protection = rep
    return rep


def protect_config(app: FastAPI, body: ProtectBody, base_url: str) -> ProtectConfig:
    """POST /v1/protection's checks: not protected already, URLs, not its own standby."""
    rep = app.state.protection
    if rep is not None and rep.state in LIVE_PROTECTION:
        raise HTTPError(409, f"this replica is already protected by {rep.cfg.standby} ({rep.pid})")
    source = _url(body.source_url or base_url, "source_url")
    cfg = ProtectConfig(_url(body.standby, "standby"), source, body.every_tokens, body.every_ms, body.lease_s,
                        body.codec)
    if cfg.standby == source:
        raise HTTPError(400, "a replica cannot be its own standby")
    return cfg


async def protection_error(_: Request, e: Exception):
    """A protection's refusal (migrate.protection.standby.ProtectionError) as its status and type."""
    assert isinstance(e, ProtectionError)
    return error_response(e.status, str(e), e.type)


@dataclass
class ProtectionRoutes:
    """What protection's routes act on (the app's `state.protection_routes`): the replica's app (its
    `state.protection` is the running Replicator, if any) and engine, its token, its StandbyTable."""

    app: FastAPI
    aengine: AsyncEngine
    token: str | None
    standby: StandbyTable
    ended: dict[str, str] = field(default_factory=dict)  # protections this replica was the source of: id -> state
    prepared: list[threading.Thread] = field(default_factory=list)  # the promotion client's warm-up, once


async def routes_state(request: Request) -> ProtectionRoutes:
    # async: FastAPI runs a plain-def dependency on its thread pool, a thread hop per request
    return request.app.state.protection_routes


router = APIRouter()  # mounted behind the replica's bearer check by install_protect_routes


# ---- as the source ----------------------------------------------------------------------------------
@router.post("/v1/protection")
async def protect(body: ProtectBody, request: Request, p: ProtectionRoutes = Depends(routes_state)):
    return start_protection(p.app, p.aengine, protect_config(p.app, body, str(request.base_url)), p.token).view()


@router.get("/v1/protection")
async def protection(p: ProtectionRoutes = Depends(routes_state)):
    return _current(p.app).view()


@router.get("/v1/protection/{pid}")
async def protection_state(pid: str, p: ProtectionRoutes = Depends(routes_state)):
    check_id(pid, "protection id")
    rep = p.app.state.protection
    if rep is not None and rep.pid == pid:
        return {"protection": pid, "state": rep.state}
    if pid in p.ended:
        return {"protection": pid, "state": p.ended[pid]}
    raise HTTPError(404, f"no protection {pid!r} here", "not_found")


@router.delete("/v1/protection")
async def unprotect(p: ProtectionRoutes = Depends(routes_state)):
    rep = _current(p.app)
    out = await rep.stop()
    p.ended[rep.pid] = rep.state
    p.app.state.protection = None
    return out


# ---- as the standby --------------------------------------------------------------------------------
@router.post("/v1/standby/{pid}/rounds")
async def standby_round(pid: str, request: Request, source: str, lease_s: float,
                        p: ProtectionRoutes = Depends(routes_state)):
    check_id(pid, "protection id")
    if not 0.2 <= lease_s <= 600:
        raise HTTPError(400, "lease_s must be in [0.2, 600]")
    if not p.prepared:  # this replica just became a standby: ready its client for a promotion
        p.prepared.append(threading.Thread(target=prepare_client, name="relayout-prepare-client", daemon=True))
        p.prepared[0].start()
    return await p.standby.receive(pid, _url(source, "source"), lease_s, request.stream())


@router.get("/v1/standby")
async def standby_list(p: ProtectionRoutes = Depends(routes_state)):
    now = p.standby.clock()
    return {"protections": [h.view(now) for h in p.standby.held.values()]}


@router.get("/v1/standby/{pid}")
async def standby_view(pid: str, p: ProtectionRoutes = Depends(routes_state)):
    return p.standby.get(check_id(pid, "protection id")).view(p.standby.clock())


@router.post("/v1/standby/{pid}/promote")
async def promote(pid: str, body: PromoteBody, p: ProtectionRoutes = Depends(routes_state)):
    check_id(pid, "protection id")
    return await p.standby.promote(pid, body.tokens, body.wait)


@router.delete("/v1/standby/{pid}")
async def drop(pid: str, p: ProtectionRoutes = Depends(routes_state)):
    return await p.standby.drop(check_id(pid, "protection id"))


def install_protect_routes(app: FastAPI, aengine: AsyncEngine, token: str | None = None) -> StandbyTable:
    """Mount protection's routes on a replica's app; returns its StandbyTable (the source side
    lives in `app.state.protection`)."""
    token = token if token is not None else env_token()
    ops = engine_ops_for(aengine)
    import_limit, frame_limit = ops.import_limits(aengine.engine)
    # RELAYOUT_STANDBY_AUTOPROMOTE=0: this replica promotes only when asked (its agent's health check
    # of the source, a gateway, a client), never on its own when a lease lapses
    standby = StandbyTable(aengine.call, source_answer(token), frame_limit=frame_limit, round_limit=import_limit,
                           autopromote=settings().standby_autopromote, keeper=standby_keeper(ops))
    app.state.protection = None
    app.state.standby = standby
    app.state.protection_routes = ProtectionRoutes(app, aengine, token, standby)
    r = APIRouter(dependencies=[Depends(bearer_auth(token))])
    r.include_router(router)
    app.include_router(r)
    app.state.body_limits.bound(lambda path: path.startswith("/v1/protection") or path.endswith("/promote"),
                                MAX_JSON_BODY)
    app.add_exception_handler(ProtectionError, protection_error)
    return standby
