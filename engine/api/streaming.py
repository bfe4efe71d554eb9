"""A session's generated tokens as OpenAI server-sent events, for both APIs.

One loop (`session_events`) serves a fresh request and a stream resumed after a move
(`GET /v1/sessions/{id}/stream?from_token=K`); the session's state remembers which API it came
from, whether it wants logprobs and a usage chunk, so the resumed stream is shaped exactly like
the one it continues. The shapes (`CompletionShape`, and `ChatShape` in engine/api/chat.py) only
turn text, ids and logprob records into one choice of a chunk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse
from relayout.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from relayout.engine.runtime.async_engine import AsyncEngine, EngineDeadError
from relayout.engine.runtime.logprobs import CompletionLogprobs, LogprobRecord
from relayout.engine.runtime.session import SamplingParams, SessionState
from relayout.engine.web import HTTPError
from relayout.storage.settings import settings


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


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class SSEResponse(StreamingResponse):
    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:  # a failed send (client gone) must still run the generator's cleanup, now
            await self.body_iterator.aclose()


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class StreamSpec:
    """What shapes a session's stream, from its state (so it travels with the session)."""

    api: str = "completion"  # "completion" | "chat"
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    include_usage: bool = False

    @classmethod
    def of(cls, s: SessionState) -> StreamSpec:
        return cls(s.api, tuple(s.sampling.stop), s.sampling.logprobs, s.include_usage)


async def admit(aengine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, api: str,
                include_usage: bool, session_id: str | None = None) -> SessionState:
    """Add a session, tagged with how its client asked, in one engine call."""
    def add(e) -> SessionState:
        s = e.add_session(prompt_ids, params, session_id)
        s.api, s.include_usage = api, include_usage
        return s

    return await aengine.call(add)


async def spec_of(aengine: AsyncEngine, sid: str) -> StreamSpec:
    """The stream spec of a session on this replica (admitted here, restored or migrated in)."""
    def find(e) -> StreamSpec:
        s = e.sessions.get(sid)
        return StreamSpec.of(s) if s is not None else StreamSpec()

    try:
        return await aengine.call(find)
    except EngineDeadError:
        return StreamSpec()


class Shape(Protocol):
    object: str

    def opening(self) -> dict | None: ...  # a choice sent before any token (chat: the role)

    def skip(self, ids: list[int]) -> None: ...  # ids sent before a resume

    def choice(self, text: str, ids: list[int], records: list[LogprobRecord] | None,
               finish: str | None) -> dict: ...


class CompletionShape:
    object = "text_completion"

    def __init__(self, tok: Tokenizer, logprobs: bool):
        self.lp = CompletionLogprobs(tok) if logprobs else None

    def opening(self) -> dict | None:
        return None

    def skip(self, ids: list[int]) -> None:
        if self.lp is not None:
            self.lp.skip(ids)

    def choice(self, text: str, ids: list[int], records: list[LogprobRecord] | None,
               finish: str | None) -> dict:
        lp = self.lp.add(ids, records) if self.lp is not None and records else None
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}


def detach_grace_s() -> float:
    """How long a session whose client vanished (a bare disconnect) waits to be reattached before it is
    aborted: RELAYOUT_DETACH_GRACE_S, default 60 s. An explicit abort (POST /v1/sessions/{id}/abort,
    what a live gateway sends when its client hangs up) frees it at once."""
    return settings().detach_grace_s


class _Reader:
    """One client's hold on a session (AsyncEngine.attach/detach), let go exactly once."""

    def __init__(self, aengine: AsyncEngine, sid: str):
        self.aengine, self.sid, self.held = aengine, sid, True
        aengine.attach(sid)

    def let_go(self, cut: bool) -> None:
        if self.held:
            self.held = False
            self.aengine.detach(self.sid, detach_grace_s() if cut else None)

    async def watch(self, request: Request) -> None:
        """Notices a disconnect even while no token flows (e.g. the session is paused)."""
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)
        self.let_go(cut=True)


def streaming_response(events: AsyncIterator[bytes]) -> SSEResponse:
    return SSEResponse(events, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def session_events(aengine: AsyncEngine, request: Request, sid: str, *, model: str, created: int,
                         shape: Shape, spec: StreamSpec, from_token: int, with_ids: bool,
                         prompt_len: int) -> AsyncIterator[bytes]:
    """SSE bytes of session `sid` from generated token `from_token` on. `[DONE]` when it finished
    here, or was checkpointed with stop (then the last chunk's finish_reason is "checkpointed":
    reattach where it is restored); a migrated session's stream just ends (reattach where it went)."""
    tok = aengine.engine.tokenizer
    ts = StopTextStream(tok, list(spec.stop))
    want_lp = spec.logprobs is not None

    def chunk(c: dict) -> bytes:
        return sse({"id": sid, "object": shape.object, "created": created, "model": model, "choices": [c]})

    complete = False
    n = 0
    reader = _Reader(aengine, sid)
    watcher = asyncio.create_task(reader.watch(request))
    try:
        if from_token == 0 and (c := shape.opening()) is not None:
            yield chunk(c)
        try:
            # from token 0: ids before from_token (already sent) only rebuild the text state
            async for batch in aengine.stream(sid):
                skip = max(0, min(len(batch), from_token - n))
                n += len(batch)
                ts.add(batch[:skip])
                shape.skip(batch[:skip])
                if skip == len(batch):
                    continue
                new = batch[skip:]
                text = ts.add(new)
                records = aengine.logprobs(sid, n - len(new), n) if want_lp else None
                if text or with_ids or records:
                    c = shape.choice(text, new, records, None)
                    if with_ids:
                        c["token_ids"] = new
                    yield chunk(c)
        except EngineDeadError as e:
            complete = True  # nothing left to abort
            yield sse({"error": {"message": str(e), "type": "engine_unavailable", "code": 503}})
            return
        snap = aengine.get(sid) or {}
        complete = True
        if snap.get("state") == "migrated":
            return  # no [DONE]: the session continues elsewhere (reattach with /stream there)
        if snap.get("state") == "checkpointed":  # text held back is not flushed: the restored stream sends it
            c = shape.choice("", [], None, "checkpointed")
            if with_ids:
                c["token_ids"] = []
            yield chunk(c)
            yield sse("[DONE]")
            return
        c = shape.choice(ts.finish(), [], None, snap.get("finish_reason"))
        if with_ids:
            c["token_ids"] = []
        yield chunk(c)
        if spec.include_usage:
            yield sse({"id": sid, "object": shape.object, "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_len, n)})
        yield sse("[DONE]")
    finally:
        watcher.cancel()
        # cut mid-stream (a bare disconnect): detached, aborted after the grace unless reattached
        reader.let_go(cut=not complete)


async def collect(aengine: AsyncEngine, request: Request, sid: str) -> tuple[list[int], list[LogprobRecord], dict]:
    """A non-streamed request: every generated id and logprob record, and the final snapshot.
    Raises 409 when the session moved away mid-request (migrated, or checkpointed with stop)."""
    reader = _Reader(aengine, sid)
    watcher = asyncio.create_task(reader.watch(request))
    try:
        out: list[int] = []
        async for batch in aengine.stream(sid):
            out += batch
    finally:
        watcher.cancel()
        reader.let_go(cut=False)
    snap = aengine.get(sid) or {}
    if snap.get("state") == "migrated":
        raise HTTPError(409, migrated_message(sid), "session_migrated")
    if snap.get("state") == "checkpointed":
        raise HTTPError(409, f"session {sid} was checkpointed with stop mid-request to "
                             f"{aengine.checkpointed_to.get(sid, '?')}; restore it and reattach with "
                             f"GET /v1/sessions/{sid}/stream there", "session_checkpointed")
    return out, aengine.logprobs(sid, 0, len(out)), snap


def migrated_message(sid: str) -> str:
    return (f"session {sid} was migrated to another replica mid-request; reattach with "
            f"GET /v1/sessions/{sid}/stream there")

