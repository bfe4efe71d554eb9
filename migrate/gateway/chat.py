"""The gateway's `/v1/chat/completions` (and the completions route's usage and logprobs helpers): streamed from a replica like completions, and kept
alive across migrations, checkpoints and failovers by the same reattach logic (migrate.gateway.sessions).

A chat session remembers that it is one (engine/api/streaming.py), so the replica's
`/v1/sessions/{id}/stream` resumes it as chat chunks, with logprobs if they were asked for and
the usage chunk (always asked for upstream: the gateway needs it for a non-streamed answer).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from relayout.engine.web import error_response
from relayout.migrate.gateway.sessions import Gateway, forward, gateway

router = APIRouter()  # the gateway's chat completions (create_gateway_app includes it)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, g: Gateway = Depends(gateway)):
    return await forward(request, g, "/v1/chat/completions", _collect)


@dataclass
class Folded:
    """What every upstream chunk of one non-streamed answer says, whatever its shape."""

    model: Any
    sid: str | None = None
    usage: dict | None = None
    ids: list[int] = field(default_factory=list)
    finish: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


async def fold_upstream(events: AsyncIterator[dict], body: dict, on_choice: Callable[[dict], None]
                        ) -> Folded | JSONResponse:
    """Read a relayed answer's chunks to the end: ids, finish reason, usage and model, and each
    choice handed to `on_choice` for what its shape adds (text, logprobs); an upstream error → 502."""
    f = Folded(model=body.get("model"))
    async for ev in events:
        if "error" in ev:
            return error_response(502, ev["error"].get("message", "upstream error"), "upstream_error")
        f.sid = ev.get("id", f.sid)
        f.model = ev.get("model", f.model)
        f.usage = ev.get("usage") or f.usage
        for c in ev.get("choices", []):
            f.ids += c.get("token_ids") or []
            f.finish = c.get("finish_reason") or f.finish
            on_choice(c)
    return f


async def _collect(events: AsyncIterator[dict], body: dict, want_ids: bool) -> Any:
    """One non-streamed chat completion from the upstream chunks."""
    text: list[str] = []
    content_lp: list[dict] | None = None

    def take(c: dict) -> None:
        nonlocal content_lp
        text.append((c.get("delta") or {}).get("content") or "")
        if c.get("logprobs") is not None:
            content_lp = (content_lp or []) + (c["logprobs"].get("content") or [])

    f = await fold_upstream(events, body, take)
    if isinstance(f, JSONResponse):
        return f
    if body.get("logprobs") and content_lp is None:
        content_lp = []
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                              "logprobs": {"content": content_lp} if content_lp is not None else None,
                              "finish_reason": f.finish}
    if want_ids:
        choice["token_ids"] = f.ids
    return {"id": f.sid, "object": "chat.completion", "created": f.created, "model": f.model, "choices": [choice],
            "usage": f.usage or {"completion_tokens": len(f.ids)}}


async def collect_completion(events: AsyncIterator[dict], body: dict, want_ids: bool) -> Any:
    """One non-streamed (legacy) completion from the upstream chunks."""
    text: list[str] = []
    logprobs: dict | None = None

    def take(c: dict) -> None:
        nonlocal logprobs
        text.append(c.get("text", ""))
        logprobs = join_completion_logprobs(logprobs, c.get("logprobs"))

    f = await fold_upstream(events, body, take)
    if isinstance(f, JSONResponse):
        return f
    choice = {"index": 0, "text": "".join(text), "logprobs": logprobs, "finish_reason": f.finish}
    if want_ids:
        choice["token_ids"] = f.ids
    return {"id": f.sid, "object": "text_completion", "created": f.created, "model": f.model, "choices": [choice],
            "usage": f.usage or {"completion_tokens": 0}}


def join_completion_logprobs(acc: dict | None, lp: dict | None) -> dict | None:
    """The legacy completions logprobs of one more chunk appended ({tokens, token_logprobs, ...} lists)."""
    if not lp:
        return acc
    return {k: (acc or {}).get(k, []) + v for k, v in lp.items()}
