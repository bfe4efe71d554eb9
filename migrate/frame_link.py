"""A raw framed TCP link between replicas for live-migration rounds (RELAYOUT_TRANSPORT=tcp).

The frames of storage.stream travel over a plain TCP connection instead of a chunked HTTP body,
so no HTTP parser touches the KV bytes. The target listens on an extra port (started on first
use, on the address its HTTP request arrived on; `GET LINK_PATH` names it). The wire:

    target -> source   LINK_MAGIC + 16 random bytes (a challenge)
    source -> target   4-byte length + JSON {"transfer", "final", "source", "mac"}
                       mac = HMAC-SHA256(token, challenge + transfer id), hex ("" without a token)
    source -> target   segments: 8-byte length + bytes of the round's frames; length 0 ends the round
    target -> source   4-byte status (HTTP's codes) + 4-byte length + JSON (the import reply, or {"error"})

A connection that ends before the zero-length segment is a cut round (kept for a resume, as an
interrupted HTTP body is); the target answers as soon as it refuses a round, so the source
learns why even while it is still sending."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import httpx
from relayout.engine.web import bearer_headers, error_message, tls_context

LINK_PATH = "/v1/sessions/import/link"
LINK_MAGIC = b"RLK1"
CHALLENGE_BYTES = 16
MAX_HELLO_BYTES = 8192
READ_PIECE = 1 << 20
_SEG = struct.Struct(">Q")
_LEN = struct.Struct(">I")
_REPLY = struct.Struct(">II")

# (transfer, pieces, final, source) -> the import reply; raises as TransferTable.import_round does
ImportRound = Callable[[str, AsyncIterator[bytes], bool, str | None], Awaitable[dict]]
# an exception raised by an import -> (status, message)
Classify = Callable[[BaseException], tuple[int, str]]


def link_mac(token: str | None, challenge: bytes, transfer: str) -> str:
    if not token:
        return ""
    return hmac.new(token.encode(), challenge + transfer.encode(), hashlib.sha256).hexdigest()


class LinkCut(Exception):
    """The source's connection ended inside a round."""


class FrameLinkServer:
    """The target's listener: each connection carries one authenticated round into `import_round`."""

    def __init__(self, token: str | None, import_round: ImportRound, classify: Classify,
                 check_transfer: Callable[[str], object], cut: type[BaseException]):
        self.token, self.import_round, self.classify = token, import_round, classify
        self.check_transfer, self.cut = check_transfer, cut
        self.server: asyncio.Server | None = None
        self.port: int | None = None
        self._lock = asyncio.Lock()

    async def ensure(self, host: str) -> int:
        """The port, listening on `host` (started by the first caller)."""
        async with self._lock:
            if self.server is None:
                port = int(os.environ.get("RELAYOUT_LINK_PORT", "0") or 0)
                self.server = await asyncio.start_server(self._serve, host, port, limit=READ_PIECE)
                self.port = self.server.sockets[0].getsockname()[1]
        return self.port  # type: ignore[return-value]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            challenge = os.urandom(CHALLENGE_BYTES)
            writer.write(LINK_MAGIC + challenge)
            status, body = await self._round(reader, challenge)
            if status:
                data = json.dumps(body).encode()
                writer.write(_REPLY.pack(status, len(data)) + data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, LinkCut):
            pass  # the source went away: nobody to answer
        finally:
            writer.close()

    async def _round(self, reader: asyncio.StreamReader, challenge: bytes) -> tuple[int, dict]:
        try:
            (n,) = _LEN.unpack(await asyncio.wait_for(reader.readexactly(_LEN.size), 30))
            if n > MAX_HELLO_BYTES:
                return 400, _err("link hello too large")
            hello = json.loads(await asyncio.wait_for(reader.readexactly(n), 30))
            tid, final, source = hello["transfer"], bool(hello.get("final")), hello.get("source")
            if not isinstance(tid, str) or not isinstance(hello.get("mac"), str):
                raise ValueError("transfer and mac must be strings")
        except (ValueError, KeyError, TypeError, asyncio.TimeoutError):
            return 400, _err("bad link hello")
        if not hmac.compare_digest(hello["mac"], link_mac(self.token, challenge, tid)):
            return 401, _err("link authentication failed")
        try:
            self.check_transfer(tid)
            return 200, await self.import_round(tid, _segments(reader, self.cut), final, source)
        except self.cut:
            return 0, {}  # the source cut the round: nobody reads an answer
        except Exception as e:  # noqa: BLE001 - refused: the source is told why, as over HTTP
            status, msg = self.classify(e)
            return status, _err(msg)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _err(msg: str) -> dict:
    return {"error": {"message": msg}}


async def _segments(reader: asyncio.StreamReader, cut: type[BaseException]) -> AsyncIterator[bytes]:
    """The round's bytes, as they arrive; `cut` when the connection ends before the end segment."""
    try:
        while True:
            (n,) = _SEG.unpack(await reader.readexactly(_SEG.size))
            if n == 0:
                return
            while n:
                piece = await reader.read(min(n, READ_PIECE))
                if not piece:
                    raise cut()
                n -= len(piece)
                yield piece
    except (asyncio.IncompleteReadError, OSError):
        raise cut() from None


class TcpTransport:
    """Pushes a round over the target's frame link (see the module docstring); https targets, which
    the raw link would not encrypt, go over `fallback` (HTTP)."""

    def __init__(self, token: str | None, fallback, push_failed: type[Exception]):
        self.token, self.fallback, self.failed = token, fallback, push_failed

    async def push(self, target: str, transfer: str, frames: AsyncIterator[bytes], *, final: bool,
                   source: str | None, timeout_s: float) -> dict:
        u = urlsplit(target)
        if u.scheme != "http":
            return await self.fallback.push(target, transfer, frames, final=final, source=source, timeout_s=timeout_s)
        writer = reply = send = None
        try:
            try:
                async with httpx.AsyncClient(verify=tls_context(), timeout=timeout_s) as c:
                    resp = await c.get(f"{target.rstrip('/')}{LINK_PATH}", headers=bearer_headers(self.token))
            except httpx.TransportError as e:
                raise self.failed(f"target link: {type(e).__name__}: {e or 'no detail'}", True) from None
            if resp.status_code >= 400:
                raise self.failed(f"target link: HTTP {resp.status_code}: {error_message(resp)}", False)
            port = resp.json().get("port")
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname, port), timeout_s)
                head = await asyncio.wait_for(reader.readexactly(len(LINK_MAGIC) + CHALLENGE_BYTES), timeout_s)
                if not head.startswith(LINK_MAGIC):
                    raise self.failed("target link: not a relayout frame link", False)
                hello = json.dumps({"transfer": transfer, "final": final, "source": source,
                                    "mac": link_mac(self.token, head[len(LINK_MAGIC):], transfer)}).encode()
                writer.write(_LEN.pack(len(hello)) + hello)
                reply = asyncio.ensure_future(_read_reply(reader))
                send = asyncio.ensure_future(_send(writer, frames, timeout_s))
                # the target may answer before the round is sent (a refusal): its answer wins
                done, _ = await asyncio.wait({reply, send}, return_when=asyncio.FIRST_COMPLETED)
                if reply not in done:
                    await send  # raises if the link failed
                    done, _ = await asyncio.wait({reply}, timeout=timeout_s)
                    if not done:
                        raise asyncio.TimeoutError()
                send.cancel()
                status, body = reply.result()
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError) as e:
                raise self.failed(f"target import: {type(e).__name__}: {e or 'no detail'}", True) from None
        finally:
            for task in (reply, send):
                if task is not None and not task.done():
                    task.cancel()
            if writer is not None:
                writer.close()
            close = getattr(frames, "aclose", None)
            if close is not None:
                await close()
        if status >= 400:
            msg = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
            raise self.failed(f"target import: HTTP {status}: {msg}", False)
        if not isinstance(body, dict):
            raise self.failed("target import: the answer is not a JSON object", False)
        return body


async def _send(writer: asyncio.StreamWriter, frames: AsyncIterator[bytes], timeout_s: float) -> None:
    async for f in frames:
        writer.write(_SEG.pack(len(f)))
        writer.write(f)
        await asyncio.wait_for(writer.drain(), timeout_s)
    writer.write(_SEG.pack(0))
    await asyncio.wait_for(writer.drain(), timeout_s)


async def _read_reply(reader: asyncio.StreamReader) -> tuple[int, object]:
    status, n = _REPLY.unpack(await reader.readexactly(_REPLY.size))
    if n > MAX_HELLO_BYTES * 128:
        raise ConnectionError("link reply too large")
    try:
        return status, json.loads(await reader.readexactly(n))
    except ValueError:
        return status, None
