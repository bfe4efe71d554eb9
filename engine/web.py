"""The HTTP toolkit every relayout front end (replica, agent, gateway) and client uses: bearer
auth, request-body limits, id validation, the one error shape, and reading errors back.

It lives at the bottom of the HTTP stack (the replica server is the lowest layer that serves
HTTP), so the agent and the gateway import it downwards.

Error shape, on every front end: `{"error": {"message": str, "type": str, "code": str | int}}`.
The replica and gateway speak OpenAI's dialect (`type` like `invalid_request_error`, `code` the
HTTP status); the agent gives a short slug in both (`not_found`, `conflict`, ...)."""

from __future__ import annotations

import functools
import hmac
import json
import re
import ssl
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from relayout.storage.settings import settings
from starlette.exceptions import HTTPException as StarletteHTTPException

# Session, transfer, checkpoint, replica and operation ids: what may appear in a URL path or a
# file name without escaping.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ID_RE = re.compile(ID_PATTERN)
# A peer replica's base URL, as a target is told its source.
URL_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/\-]*)?$")
MAX_JSON_BODY = 1 << 20  # control-plane JSON bodies: ids, layouts, URIs

SLUGS = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "invalid_request", 409: "conflict",
         413: "too_large",
         422: "invalid_request", 429: "too_many_requests", 500: "internal", 501: "not_implemented",
         502: "bad_gateway", 503: "unavailable"}


class HTTPError(Exception):
    """A refusal with its HTTP status; `type`/`code` default to the front end's dialect."""

    def __init__(self, status: int, message: str, type_: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


def openai_type(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")


def error_response(status: int, message: str, type_: str | None = None,
                   code: str | int | None = None) -> JSONResponse:
    """The one error body. Without `type_`/`code`: OpenAI's dialect (type by status, code = status)."""
    body = {"message": message, "type": type_ or openai_type(status), "code": status if code is None else code}
    return JSONResponse({"error": body}, status_code=status)


async def json_object(request: Request) -> dict:
    """A request's body as a JSON object, else HTTPError 400 saying why it is not one (for routes
    that take any body and pass it on, as the gateway's)."""
    try:
        body = await request.json()
    except ValueError:
        raise HTTPError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object")
    return body


def validation_message(exc: RequestValidationError, limit: int = 5) -> str:
    parts = []
    for e in exc.errors()[:limit]:
        if e.get("type") == "json_invalid":
            return f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}"
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI, dialect: str = "openai", validation_status: int = 400) -> None:
    """Every failure answers in the one shape, never with a stack trace. `dialect` "openai"
    (replica, gateway) or "agent" (slugs in `type` and `code`)."""

    def respond(status: int, message: str, type_: str | None = None, code: str | int | None = None) -> JSONResponse:
        if dialect == "agent":
            slug = code if isinstance(code, str) else SLUGS.get(status, "error")
            return error_response(status, message, slug, slug)
        return error_response(status, message, type_, code)

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, e: HTTPError):
        return respond(e.status, e.message, e.type, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        return respond(validation_status, validation_message(e), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(_: Request, e: StarletteHTTPException):
        return respond(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        return respond(500, f"internal error: {type(e).__name__}", "server_error")


# ---- ids --------------------------------------------------------------------------------------
def check_id(value: Any, what: str = "id", status: int = 400) -> str:
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise HTTPError(status, f"invalid {what} {value!r}" if status != 404 else f"no {what} {value!r}")
    return value


def check_ids(values: Iterable[Any] | None, what: str = "session id") -> list[str] | None:
    if values is None:
        return None
    return [check_id(v, what) for v in values]


# ---- auth -------------------------------------------------------------------------------------
def env_token() -> str | None:
    return settings().token or None


@functools.lru_cache(maxsize=1)
def tls_context() -> ssl.SSLContext:
    """One TLS context for every HTTP client this process makes. httpx builds a fresh one (loading
    the CA bundle: ~40-80 ms of CPU here) for each client made without one, and the source makes a
    client per migration round, the final round included: that was most of a short stall."""
    import httpx

    return httpx.create_ssl_context()


def bearer_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def bearer_auth(token: str | Callable[[], str | None] | None) -> Callable[[Request], None]:
    """A FastAPI dependency: 401 unless the request carries `Bearer <token>` (constant-time
    compare). No token configured: open. `token` may be a callable read on every request."""

    def auth(request: Request) -> None:
        want = token() if callable(token) else token
        if not want:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {want}".encode()):
            raise HTTPError(401, "missing or wrong bearer token", "authentication_error")

    return auth


def env_api_keys() -> list[str]:
    """Client API keys from RELAYOUT_API_KEYS (comma-separated); none: the client routes are open."""
    return settings().api_key_list()


class ClientKeyAuth:
    """ASGI middleware: the client routes (`protects(method, path)`) need `Authorization: Bearer <key>`
    with one of `keys` (OpenAI's and vLLM's `--api-key`), else 401 in OpenAI's error shape. `token`
    (the agent/replica token, RELAYOUT_TOKEN) is also accepted there, so relayout's own callers (the
    gateway, the agent) need no client key; a client key never opens a token-only route. No keys: open."""

    def __init__(self, app, keys: Iterable[str], protects: Callable[[str, str], bool], token: str | None = None):
        self.app, self.protects = app, protects
        self.accepted = [f"Bearer {k}".encode() for k in keys] + ([f"Bearer {token}".encode()] if token else [])
        self.open = not keys

    def allowed(self, got: bytes) -> bool:
        ok = False
        for want in self.accepted:  # every key compared, in constant time each
            ok |= hmac.compare_digest(got, want)
        return ok

    async def __call__(self, scope, receive, send):
        if self.open or scope["type"] != "http" or not self.protects(scope.get("method", ""), scope.get("path", "")):
            return await self.app(scope, receive, send)
        got = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        if self.allowed(got):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": "Incorrect or missing API key: pass it as `Authorization: Bearer "
                                                "<key>`", "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


# ---- body limits ------------------------------------------------------------------------------
class BodyLimits:
    """The one table of body limits of an app: each concern that adds routes bounds its own paths
    here (`bound`), and a single BodyLimit middleware reads it — one buffering pass per request,
    however many concerns the app serves."""

    def __init__(self) -> None:
        self.rules: list[tuple[Callable[[str], bool], int]] = []

    def bound(self, matches: Callable[[str], bool], limit: int) -> None:
        self.rules.append((matches, limit))

    def __call__(self, path: str) -> int | None:
        return next((limit for matches, limit in self.rules if matches(path)), None)


class BodyLimit:
    """ASGI middleware: a request body over `limit(path)` bytes is refused with 413 before any
    route parses it (declared content-length checked first, then the bytes as they arrive).
    `limit(path)` returns None for paths it does not bound (e.g. a streamed import)."""

    def __init__(self, app, limit: Callable[[str], int | None], dialect: str = "openai"):
        self.app, self.limit, self.dialect = app, limit, dialect

    async def _refuse(self, send, status: int, message: str) -> None:
        slug = SLUGS.get(status, "error")
        err = {"message": message, "type": slug if self.dialect == "agent" else "invalid_request_error",
               "code": slug if self.dialect == "agent" else status}
        body = json.dumps({"error": err}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.limit(scope.get("path", ""))
        if limit is None:
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    if int(v) > limit:
                        return await self._refuse(send, 413, f"request body over {limit} bytes")
                except ValueError:
                    return await self._refuse(send, 400, "bad content-length")
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > limit:
                return await self._refuse(send, 413, f"request body over {limit} bytes")
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# ---- clients ----------------------------------------------------------------------------------
def error_message(resp: Any) -> str:
    """The message of an error response from any relayout front end (or its text)."""
    try:
        return str(resp.json()["error"]["message"])
    except Exception:  # noqa: BLE001 - any non-JSON or foreign error body
        return resp.text[:500]


def check_response(resp: Any, what: str) -> dict:
    """The JSON body of a success; a RuntimeError naming `what`, the status and the message otherwise."""
    if resp.status_code >= 400:
        raise RuntimeError(f"{what}: HTTP {resp.status_code}: {error_message(resp)}")
    return resp.json()
