"""Reading one vLLM completion stream (server-sent events with token ids) into `Arrival`s: what a
session's vLLM request brought, put on the engine's queue for its step to apply."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx


@dataclass
class Arrival:
    """What one read of a session's vLLM stream brought: ids, their logprob records, vLLM's finish."""

    session_id: str
    generation: int  # the request it came from: a resubmitted session ignores its old request's tail
    token_ids: list[int]
    records: list[list] | None
    finish_reason: str | None = None
    error: str | None = None


def records(lp: dict | None, n: int) -> list[list] | None:
    """vLLM's completion logprobs (tokens as "token_id:N") as relayout records [logprob, top ids, top logprobs]."""
    if not lp:
        return None
    out = []
    tops = lp.get("top_logprobs") or [None] * n
    for chosen, top in zip(lp.get("token_logprobs") or [], tops, strict=False):
        pairs = sorted(((int(k.rsplit(":", 1)[1]), float(v)) for k, v in (top or {}).items()),
                       key=lambda p: -p[1])
        out.append([float(chosen) if chosen is not None else 0.0, [p[0] for p in pairs], [p[1] for p in pairs]])
    return out


async def sse_events(r: httpx.Response):
    """The `data:` payloads of a server-sent event stream. Split here on bytes: httpx's aiter_lines
    re-scans its whole buffer per line, so a stream read behind (thousands of events in one read)
    held the GIL for seconds, and the replica's event loop with it."""
    buf = b""
    async for chunk in r.aiter_bytes():
        buf += chunk
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            for line in ev.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:].strip()


async def stream_completion(client: httpx.AsyncClient, sid: str, gen: int, body: dict,
                            put: Callable[[Arrival], None]) -> None:
    """POST `body` to vLLM's /v1/completions and `put` each batch of tokens, vLLM's finish or an error."""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:500]
                put(Arrival(sid, gen, [], None, error=f"vLLM answered {r.status_code}: {text}"))
                return
            async for data in sse_events(r):
                if data == b"[DONE]":
                    return
                obj = json.loads(data)
                if "error" in obj:
                    put(Arrival(sid, gen, [], None, error=str(obj["error"])))
                    return
                for ch in obj.get("choices") or []:
                    ids = list(ch.get("token_ids") or [])
                    fin = ch.get("finish_reason")
                    if ids or fin:
                        put(Arrival(sid, gen, ids, records(ch.get("logprobs"), len(ids)), fin))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - vLLM went away mid-stream: the session ends, saying why
        put(Arrival(sid, gen, [], None, error=f"vLLM stream failed: {type(e).__name__}: {e}"))
