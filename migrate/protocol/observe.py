"""The trace of one live migration (docs/observability.md): a `migration` span with one child
span per phase — `pre-copy` (one per round, with its bytes), `stop-and-copy` (the final round,
with its bytes), `prepared` (the target holds the sessions), `committed` (the source released
them, the target is told to resume) — and `first-token`, from the commit until the target
streams its first token of a moved session. The replicas' server spans hang below the phase
that called them (the migrator's HTTP requests carry `traceparent`).

migrate.protocol.live calls `phase_boundary(name)` at each phase boundary and `round_bytes(n, s)` after
each round; `traced_migration` wraps `migrate_live`. With tracing off all of it is a no-op."""

from __future__ import annotations

import contextvars
import functools
import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
from opentelemetry import context as otel_context
from opentelemetry import trace
from relayout.engine import tracing
from relayout.engine.web import bearer_headers, tls_context

FIRST_TOKEN_TIMEOUT_S = 60.0


class _Phases:
    """The migration's current phase span, made current so that the HTTP calls of the phase are its children."""

    def __init__(self, root: trace.Span):
        self.root = root
        self.current: trace.Span | None = None
        self.token: object | None = None

    def enter(self, name: str) -> None:
        self.close()
        if name == "done":
            return
        base, _, index = name.partition(":")  # "pre-copy:K": round K of the pre-copy
        attrs = tracing.attributes({"round": int(index)} if index.isdigit() else {})
        self.current = tracing.tracer().start_span(base, context=trace.set_span_in_context(self.root),
                                                   attributes=attrs)
        self.token = otel_context.attach(trace.set_span_in_context(self.current))

    def close(self, error: BaseException | None = None) -> None:
        if self.current is None:
            return
        if self.token is not None:
            otel_context.detach(self.token)  # type: ignore[arg-type]
        if error is not None:
            self.current.record_exception(error)
            tracing.mark_error(self.current, str(error))
        self.current.end()
        self.current = self.token = None


_PHASES: contextvars.ContextVar[_Phases | None] = contextvars.ContextVar("relayout_migration_phases", default=None)


def phase_boundary(name: str) -> None:
    """migrate.protocol.live, at each phase boundary ("pre-copy:K", "stop-and-copy", "prepared", "committed", "done")."""
    ph = _PHASES.get()
    if ph is not None:
        ph.enter(name)


def round_bytes(nbytes: int, seconds: float) -> None:
    """migrate.protocol.live, after a round: its size and duration on the phase span."""
    tracing.set_attrs(bytes=nbytes, seconds=round(seconds, 6))


def traced_migration(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `migrate_live(source_url, target_url, sessions=None, *, plan=..., token=...)` in its trace."""

    @functools.wraps(fn)
    def wrapper(source_url: str, target_url: str, *args: Any, **kwargs: Any) -> Any:
        if not tracing.tracing_enabled():
            return fn(source_url, target_url, *args, **kwargs)
        with tracing.span("migration", source=source_url, target=target_url, mode=getattr(kwargs.get("plan"), "mode", "live")) as root:
            ph = _Phases(root)
            reset = _PHASES.set(ph)
            try:
                res = fn(source_url, target_url, *args, **kwargs)
            except BaseException as e:
                ph.close(e)
                root.set_attributes(tracing.attributes({"failed_phase": getattr(e, "phase", None)}))
                raise
            finally:
                ph.close()
                _PHASES.reset(reset)
            root.set_attributes(tracing.attributes({
                "transfer": res.transfer_id, "sessions": list(res.sessions), "bytes": res.bytes_total,
                "stall_ms": round(res.stall_ms, 3), "rounds": len(res.rounds), "retries": res.retries}))
            if res.sessions:
                watch_first_token(source_url, target_url, res.sessions[0], kwargs.get("token"), root)
            return res

    return wrapper


def watch_first_token(source: str, target: str, sid: str, token: str | None, parent: trace.Span) -> None:
    """A `first-token` span from now (the commit) until the target streams its first token of `sid`
    past what the source had generated; ended by a background thread (the migrator does not wait)."""
    s = tracing.tracer().start_span("first-token", context=trace.set_span_in_context(parent),
                                    attributes=tracing.attributes({"session": sid, "target": target}))

    def watch() -> None:
        outcome = "timeout"
        try:
            with trace.use_span(s, end_on_exit=False), \
                    httpx.Client(verify=tls_context(), timeout=FIRST_TOKEN_TIMEOUT_S, event_hooks=tracing.inject_hooks()) as c:
                # the source keeps a released session's tokens: where the target takes over
                handed = len(c.get(f"{source.rstrip('/')}/v1/sessions/{sid}",
                                   headers=bearer_headers(token)).json().get("token_ids") or [])
                s.set_attribute("relayout.from_token", handed)
                with c.stream("GET", f"{target.rstrip('/')}/v1/sessions/{sid}/stream",
                              params={"from_token": handed, "return_token_ids": True},
                              headers=bearer_headers(token)) as resp:
                    outcome = f"HTTP {resp.status_code}"
                    for line in resp.iter_lines():
                        if line.startswith("data: "):
                            data = line[6:]
                            outcome = "finished" if data == "[DONE]" else _token_or_event(data)
                            if outcome != "event":  # e.g. a chat stream's role chunk comes first
                                break
        except (httpx.HTTPError, ValueError) as e:
            outcome = f"error: {type(e).__name__}"
        finally:
            s.set_attribute("relayout.outcome", outcome)
            s.end()

    threading.Thread(target=watch, name=f"first-token-{sid}", daemon=True).start()


def _token_or_event(data: str) -> str:
    try:
        ev = json.loads(data)
    except ValueError:
        return "unreadable event"
    if "error" in ev:
        return "error"
    return "token" if any(c.get("token_ids") for c in ev.get("choices", [])) else "event"
