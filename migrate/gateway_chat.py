"""The gateway's `/v1/chat/completions` (and the completions route's usage and logprobs helpers): streamed from a replica like completions, and kept
alive across migrations, checkpoints and failovers by the same reattach logic (migrate.gateway_sessions).

A chat session remembers that it is one (engine/streaming.py), so the replica's
`/v1/sessions/{id}/stream` resumes it as chat chunks, with logprobs if they were asked for and
the usage chunk (always asked for upstream: the gateway needs it for a non-streamed answer).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from relayout.engine.web import error_response
from relayout.migrate.gateway_sessions import Upstreams, open_upstream, relay_sse, unless_client_leaves


def install_chat_gateway_route(app: FastAPI, ups: Upstreams, client: httpx.AsyncClient) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        want_stream = bool(body.get("stream"))
        want_ids = bool(body.get("return_token_ids"))
        up = {**body, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
        opened = await open_upstream(ups, client, "/v1/chat/completions", up, request.headers.get("authorization"))
        if isinstance(opened, JSONResponse):
            return opened
        stream, events = opened
        if want_stream:
            return relay_sse(stream, events, body, want_ids)
        answer = await unless_client_leaves(request, stream, _collect(events, body, want_ids))
        return answer if answer is not None else Response(status_code=499)  # nobody reads it


async def _collect(events: AsyncIterator[dict], body: dict, want_ids: bool) -> Any:
    """One non-streamed chat completion from the upstream chunks."""
    text: list[str] = []
    ids: list[int] = []
    content_lp: list[dict] | None = None
    finish, sid, model, usage = None, None, body.get("model"), None
    created = int(time.time())
    async for ev in events:
        if "error" in ev:
            return error_response(502, ev["error"].get("message", "upstream error"), "upstream_error")
        sid = ev.get("id", sid)
        model = ev.get("model", model)
        usage = ev.get("usage") or usage
        for c in ev.get("choices", []):
            text.append((c.get("delta") or {}).get("content") or "")
            ids += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
            if c.get("logprobs") is not None:
                content_lp = (content_lp or []) + (c["logprobs"].get("content") or [])
    if body.get("logprobs") and content_lp is None:
        content_lp = []
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                              "logprobs": {"content": content_lp} if content_lp is not None else None,
                              "finish_reason": finish}
    if want_ids:
        choice["token_ids"] = ids
    return {"id": sid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": usage or {"completion_tokens": len(ids)}}


def join_completion_logprobs(acc: dict | None, lp: dict | None) -> dict | None:
    """The legacy completions logprobs of one more chunk appended ({tokens, token_logprobs, ...} lists)."""
    if not lp:
        return acc
    return {k: (acc or {}).get(k, []) + v for k, v in lp.items()}
