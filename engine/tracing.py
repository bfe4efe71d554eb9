"""Tracing of the operations that move sessions (docs/observability.md), with OpenTelemetry.

Every process (agent, replica, gateway) calls `setup_tracing(service)` once at start. With
the standard OpenTelemetry environment variables naming an exporter (`OTEL_EXPORTER_OTLP_ENDPOINT`
or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp|console`) it installs
the SDK with a batching exporter; otherwise it installs nothing: the API's default tracer
makes non-recording spans, so an untraced process does no span work at all.

Context crosses processes in the W3C `traceparent` header: `inject_hooks()` /
`async_inject_hooks()` are httpx event hooks that add it to every outgoing request; on the
serving side FastAPI itself continues the caller's trace in a server span per request (its
built-in OpenTelemetry support, active once a tracer provider is installed), and
`BodySizeMiddleware` adds the body sizes to that span.

It lives at the bottom of the HTTP stack (next to engine.web), so every layer imports it downwards."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACER_NAME = "relayout"
_PROPAGATOR = TraceContextTextMapPropagator()
_enabled = False


def exporter_from_env() -> str | None:
    """The span exporter the standard environment asks for: "otlp", "console" or None (tracing off)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if names:
        return next((n for n in names if n in ("otlp", "console")), None)  # "none" (or unknown): off
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return "otlp"
    return None


def setup_tracing(service_name: str) -> bool:
    """Install the SDK when the environment configures an exporter; True when tracing is on.
    `service_name` is the default for `service.name` (`OTEL_SERVICE_NAME` wins)."""
    global _enabled
    kind = exporter_from_env()
    if kind is None or _enabled:
        return _enabled
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attrs))  # shut down (flushed) at exit
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter: Any = OTLPSpanExporter()  # endpoint, headers, timeout: OTEL_EXPORTER_OTLP_* variables
    else:
        exporter = ConsoleSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* variables tune the batching
    trace.set_tracer_provider(provider)
    _enabled = True
    return True


def tracing_enabled() -> bool:
    """True once a recording tracer provider is installed (by setup_tracing, or by a test)."""
    return _enabled or not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


@contextmanager
def span(name: str, kind: SpanKind = SpanKind.INTERNAL, **attrs: Any) -> Iterator[Span]:
    """A span around a block, child of the current one; attributes are `relayout.<key>` unless dotted.
    An exception leaving the block marks the span as an error (and is re-raised)."""
    with tracer().start_as_current_span(name, kind=kind, attributes=attributes(attrs)) as s:
        yield s


@contextmanager
def continued_span(name: str, traceparent: object, kind: SpanKind = SpanKind.SERVER, **attrs: Any) -> Iterator[Span]:
    """A span continuing a caller's trace from the W3C `traceparent` it sent, for a protocol without
    HTTP headers (the frame link's hello); a missing or malformed one starts a new trace."""
    ctx = _PROPAGATOR.extract({"traceparent": traceparent}) if isinstance(traceparent, str) else None
    with tracer().start_as_current_span(name, context=ctx, kind=kind, attributes=attributes(attrs)) as s:
        yield s


def traced(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: every call of the function is a `name` span (child of the current one)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with tracer().start_as_current_span(name):
                return fn(*args, **kwargs)

        return run

    return wrap


def attributes(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry attributes from keyword arguments: None dropped, lists of str kept, else str()."""
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if v is None:
            continue
        key = k if "." in k else f"relayout.{k}"
        if isinstance(v, (bool, int, float, str)):
            out[key] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
            out[key] = list(v)
        else:
            out[key] = str(v)
    return out


def mark_error(s: Span, message: str) -> None:
    """Mark a span as failed, with a short reason."""
    s.set_status(Status(StatusCode.ERROR, message[:200]))


def set_attrs(**attrs: Any) -> None:
    """Add attributes to the current span (a no-op when it does not record)."""
    s = trace.get_current_span()
    if s.is_recording():
        s.set_attributes(attributes(attrs))


# ---- propagation --------------------------------------------------------------------------------
def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """`headers` plus the current span's `traceparent` (unchanged when no span is current)."""
    headers = {} if headers is None else headers
    _PROPAGATOR.inject(headers)
    return headers


def _inject_request(request: Any) -> None:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    for k, v in carrier.items():
        request.headers.setdefault(k, v)


async def _inject_request_async(request: Any) -> None:
    _inject_request(request)


def inject_hooks() -> dict[str, list]:
    """`event_hooks` for an httpx.Client: every request carries the caller's trace context."""
    return {"request": [_inject_request]}


def async_inject_hooks() -> dict[str, list]:
    """`event_hooks` for an httpx.AsyncClient."""
    return {"request": [_inject_request_async]}


class BodySizeMiddleware:
    """ASGI middleware: the request and response body sizes on the request's server span.

    FastAPI makes that span itself once a tracer provider is installed (continuing the caller's
    `traceparent`, named after the route); this adds what it does not record, the bytes, which
    for a transfer's export and import routes are the bytes of the round."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = trace.get_current_span()
        if not s.is_recording():
            # a FastAPI without its own server spans (vLLM pins fastapi < 0.137): make the span here,
            # continuing the caller's traceparent, named after the route once routing found it
            headers = dict(scope.get("headers") or [])
            tp = headers.get(b"traceparent", b"").decode("latin-1") or None
            method = scope.get("method", "GET")
            with continued_span(f"{method} {scope.get('path', '')}", tp,
                                **{"http.request.method": method, "url.path": scope.get("path", "")}) as own:
                try:
                    await self._counted(own, scope, receive, send, own_span=True)
                finally:
                    route = getattr(scope.get("route"), "path", None)
                    if route:
                        own.update_name(f"{scope.get('method', 'GET')} {route}")
            return None
        await self._counted(s, scope, receive, send)

    async def _counted(self, s: Span, scope: dict, receive: Any, send: Any, own_span: bool = False) -> None:
        sizes = {"in": 0, "out": 0}

        async def counting_receive():
            msg = await receive()
            if msg.get("type") == "http.request":
                sizes["in"] += len(msg.get("body", b""))
            return msg

        async def counting_send(msg):
            if msg["type"] == "http.response.start":
                s.set_attribute("http.request.body.size", sizes["in"])
                if own_span:
                    s.set_attribute("http.response.status_code", int(msg.get("status", 0)))
                    if int(msg.get("status", 0)) >= 500:
                        s.set_status(Status(StatusCode.ERROR))
            elif msg["type"] == "http.response.body":
                sizes["out"] += len(msg.get("body", b""))
                if not msg.get("more_body", False):  # the span ends with the last piece
                    s.set_attribute("http.response.body.size", sizes["out"])
            await send(msg)

        await self.app(scope, counting_receive, counting_send)


def install_tracing(app: Any) -> None:
    """Add BodySizeMiddleware to a FastAPI app when tracing is on (nothing otherwise: no cost per request)."""
    if tracing_enabled():
        app.add_middleware(BodySizeMiddleware)
