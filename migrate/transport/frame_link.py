"""A raw framed TCP link between replicas for live-migration rounds (the default transport, `tcp`).

The frames of storage.stream travel over a plain TCP connection instead of a chunked HTTP body,
so no HTTP parser, event loop or intermediate buffer touches the KV bytes: the source writes each
frame piece (a chunk buffer straight out of the copy from its pool) with `sendall` from the
thread that produced it, and the target reads each chunk's bytes with `recv_into` straight into
the buffer it keeps them in (storage.stream.StreamReceiver.receive_from), on the round worker that
took the connection, which also answers it. The target listens on an extra port (started on first
use, on the address its HTTP request arrived on; `GET LINK_PATH`, behind the replica's bearer
token, names it). The wire:

    target -> source   LINK_MAGIC + 16 random bytes (a challenge)
    source -> target   4-byte length + JSON {"transfer", "final", "source", "mac"[, "sessions"]}
                       mac = HMAC-SHA256(token, challenge + transfer id), hex ("" without a token)
                       sessions: the round's header, session id -> KV tokens (to a target whose
                       link address says "header": true)
    target -> source   a reply with status 100 (go on), or the refusal (as below)
    source -> target   the round's frames, ending with its MANIFEST frame (or an ABORT frame)
    target -> source   4-byte status (HTTP's codes) + 4-byte length + JSON (the import reply, or {"error"})

A connection that ends before the manifest is a cut round (kept for a resume, as an interrupted
HTTP body is); so is one silent for RELAYOUT_LINK_IDLE_S (default 30) seconds. The target answers
as soon as it refuses a round and reads on until the source stops, so the source learns why even
while it is still sending."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

import httpx
from relayout.engine.tracing import continued_span, inject
from relayout.engine.web import bearer_headers, error_message, tls_context
from relayout.migrate.transport.base import PRECOPY_WORKERS, ROUND_WORKERS, RoundFrames, on_worker
from relayout.storage.settings import settings

LINK_PATH = "/v1/sessions/import/link"
LINK_MAGIC = b"RLK2"  # 2: frames follow the go-ahead unsegmented (RLK1 wrapped them in length segments)
CHALLENGE_BYTES = 16
MAX_HELLO_BYTES = 1 << 20  # its header names each session of the round (an older target took 8 KiB: see `header`)
MAX_HEADER_SESSIONS = 4096  # sessions a hello's header may name (a round with more sends none: all staged)
MAX_REPLY_BYTES = 1 << 20
MAX_CONNECTIONS = 16  # link connections served at once (each a thread); more are closed unanswered
HELLO_TIMEOUT_S = 30.0
GO_ON = 100  # the target accepted the hello: send the round
SEND_BATCH_BYTES = 1 << 20  # pieces gathered into one sendmsg
MAX_IOV = 512  # pieces per sendmsg (Linux takes up to 1024)
_LEN = struct.Struct(">I")
_REPLY = struct.Struct(">II")

# (transfer, read_into, final, source, header, loop, go_on) -> the import reply, on the calling thread; raises as
# migrate.protocol.transfers.TransferTable.import_link_round does
ImportRound = Callable[[str, Callable[[memoryview], int], bool, str | None, dict[str, int],
                        asyncio.AbstractEventLoop, Callable[[], None]], dict]
# an exception raised by an import -> (status, message)
Classify = Callable[[BaseException], tuple[int, str]]


def link_mac(token: str | None, challenge: bytes, transfer: str) -> str:
    if not token:
        return ""
    return hmac.new(token.encode(), challenge + transfer.encode(), hashlib.sha256).hexdigest()


class LinkAddress(NamedTuple):
    """A target's link, as its `GET LINK_PATH` answered."""

    host: str
    port: int
    entries: bool  # it writes chunk frames that name their entry into its pool as they arrive
    header: bool = False  # its hello takes the round's header (`sessions`), and up to MAX_HELLO_BYTES


def link_address(port: int, entries: bool = True) -> dict:
    """What `GET LINK_PATH` answers: the link's port, or RELAYOUT_LINK_ADVERTISE's HOST:PORT where
    sources reach it through a forwarded port (NAT, a Kubernetes Service, a test's proxy)."""
    adv = settings().link_advertise  # HOST:PORT, checked by its declaration
    # entries: this target writes chunk frames that name their entry into its pool as they arrive;
    # header (since 0.7.0): a hello may name the round's sessions, reserved for before the first chunk
    if not adv:
        return {"port": port, "entries": entries, "header": True}
    host, _, p = adv.rpartition(":")
    return {"host": host.strip("[]"), "port": int(p), "entries": entries, "header": True}


def idle_timeout() -> float:
    return settings().link_idle_s


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the peer closed the link")
        got += k
    return bytes(buf)


def _batches(pieces: Iterator[bytes], max_bytes: int = SEND_BATCH_BYTES) -> Iterator[list[memoryview]]:
    """The pieces in groups of about `max_bytes`, each group one `sendmsg`: a frame's small head and
    header pieces travel with the payload after them instead of as a syscall (and a packet) each."""
    batch: list[memoryview] = []
    n = 0
    for p in pieces:
        v = memoryview(p).cast("B")
        batch.append(v)
        n += v.nbytes
        if n >= max_bytes or len(batch) >= MAX_IOV:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """sendmsg until every byte of `views` is sent (sendmsg may send part of them)."""
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views = views[1:]
        if sent:
            views[0] = views[0][sent:]


def _reply_bytes(status: int, body: object) -> bytes:
    data = json.dumps(body).encode()
    return _REPLY.pack(status, len(data)) + data


def _read_reply(sock: socket.socket) -> tuple[int, object]:
    status, n = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
    if n > MAX_REPLY_BYTES:
        raise ConnectionError("link reply too large")
    try:
        return status, json.loads(_recv_exact(sock, n))
    except ValueError:
        return status, None


class _HelloTooLarge(ValueError):
    """A hello declared longer than MAX_HELLO_BYTES."""


@dataclass
class _Hello:
    """A connection whose hello the acceptor is still reading (non-blocking: a slow source holds up no one)."""

    challenge: bytes
    deadline: float
    buf: bytearray = field(default_factory=bytearray)

    def complete(self) -> bytes | None:
        """The hello's JSON once all of it arrived (_HelloTooLarge: longer than a hello may be)."""
        if len(self.buf) < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(self.buf)
        if n > MAX_HELLO_BYTES:
            raise _HelloTooLarge("link hello too large")
        return bytes(self.buf[_LEN.size : _LEN.size + n]) if len(self.buf) >= _LEN.size + n else None


class FrameLinkServer:
    """The target's listener. One thread accepts connections and reads each one's hello without
    blocking on any (a selector); a connection whose hello is in goes to a round worker (a pre-copy
    one for a pre-copy round), which checks it, runs the whole round on itself (`import_round`:
    migrate.protocol.transfers.TransferTable.import_link_round) and writes the answer."""

    def __init__(self, token: str | None, import_round: ImportRound, classify: Classify,
                 check_id: Callable[[str, str], object], cut: type[BaseException]):
        self.token, self.import_round, self.classify = token, import_round, classify
        self.check_id, self.cut = check_id, cut
        self.sock: socket.socket | None = None
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = asyncio.Lock()

    async def ensure(self, host: str) -> int:
        """The port, listening on `host` (started by the first caller)."""
        async with self._lock:
            if self.sock is None:
                self._loop = asyncio.get_running_loop()
                port = settings().link_port
                self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
                self.port = self.sock.getsockname()[1]
                threading.Thread(target=self._accept, args=(self.sock,), name="frame-link", daemon=True).start()
        return self.port  # type: ignore[return-value]

    def _accept(self, lsock: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        lsock.setblocking(False)  # a connection reset before its accept must not hold the acceptor up
        sel.register(lsock, selectors.EVENT_READ)
        try:
            while lsock.fileno() >= 0:  # (closed: `close`)
                waits = [k.data.deadline for k in sel.get_map().values() if k.data is not None]
                events = sel.select(max(0.0, min([*waits, time.monotonic() + 1.0]) - time.monotonic()))
                for key, _ in events:
                    if key.data is None:
                        self._new_connection(sel, lsock)
                    else:
                        self._hello_bytes(sel, key.fileobj, key.data)  # type: ignore[arg-type]
                now = time.monotonic()
                for key in [k for k in sel.get_map().values() if k.data is not None and k.data.deadline <= now]:
                    self._hand_on(sel, key.fileobj, key.data, None, TimeoutError())  # type: ignore[arg-type]
        except OSError:
            return  # the listening socket was closed
        finally:
            for key in list(sel.get_map().values()):
                if key.data is not None:
                    key.fileobj.close()  # type: ignore[union-attr]
                    self._slots.release()
            sel.close()

    def _new_connection(self, sel: selectors.BaseSelector, lsock: socket.socket) -> None:
        try:
            conn, _ = lsock.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return  # (gone before it was taken)
        conn.setblocking(True)
        if not self._slots.acquire(blocking=False):
            conn.close()
            return
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = os.urandom(CHALLENGE_BYTES)
            conn.sendall(LINK_MAGIC + challenge)  # (20 bytes into an empty socket buffer: never blocks)
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ, _Hello(challenge, time.monotonic() + HELLO_TIMEOUT_S))
        except OSError:
            conn.close()
            self._slots.release()

    def _hello_bytes(self, sel: selectors.BaseSelector, conn: socket.socket, h: _Hello) -> None:
        try:
            data = conn.recv(MAX_HELLO_BYTES + _LEN.size - len(h.buf))
            if not data:
                raise ConnectionError("the source closed the link")
            h.buf += data
            hello = h.complete()
        except BlockingIOError:
            return  # (woken with nothing to read after all)
        except (OSError, ConnectionError):
            sel.unregister(conn)
            conn.close()
            self._slots.release()
            return
        except _HelloTooLarge as e:
            return self._hand_on(sel, conn, h, None, e)
        if hello is not None:
            self._hand_on(sel, conn, h, hello, None)

    def _hand_on(self, sel: selectors.BaseSelector, conn: socket.socket, h: _Hello, hello: bytes | None,
                 error: Exception | None) -> None:
        """The connection, its hello in (or refused), to a round worker: the round's one hand-off. The
        hello is parsed here, once: whether the round is final picks the worker; the worker checks the rest."""
        try:
            sel.unregister(conn)
            conn.setblocking(True)
            parsed: object = None
            if hello is not None:
                try:
                    parsed = json.loads(hello)
                except Exception as e:  # noqa: BLE001 - not JSON, nested too deep: the worker refuses it
                    error = e
            final = isinstance(parsed, dict) and bool(parsed.get("final"))
            pool = ROUND_WORKERS if final or parsed is None else PRECOPY_WORKERS  # a pre-copy round's reader is niced
            pool.submit(lambda: self._serve(conn, h.challenge, parsed, error))
        except BaseException:  # noqa: BLE001 - nothing a peer sends may end the acceptor: this connection ends
            conn.close()
            self._slots.release()

    def _serve(self, conn: socket.socket, challenge: bytes, hello: object, error: Exception | None) -> None:
        try:
            with conn:
                conn.settimeout(HELLO_TIMEOUT_S)  # (until the round is open: then RELAYOUT_LINK_IDLE_S)
                status, body = self._round(conn, challenge, hello, error)
                if status:
                    conn.sendall(_reply_bytes(status, body))
                    if status >= 300:
                        _drain(conn)  # a refusal mid-round: read on, so the sender sees the answer, not a reset
        except (OSError, ConnectionError):
            pass  # the source went away: nobody to answer
        finally:
            self._slots.release()

    def _round(self, conn: socket.socket, challenge: bytes, hello: object,
               error: Exception | None) -> tuple[int, object]:
        """`hello`: the parsed hello (None with `error`: none came, or none that parses)."""
        if hello is None:
            return 400, _err(str(error) if isinstance(error, _HelloTooLarge) else "bad link hello")
        try:
            if not isinstance(hello, dict):
                raise ValueError("a hello is a JSON object")
            tid, final, source = hello["transfer"], bool(hello.get("final")), hello.get("source")
            header = hello.get("sessions") or {}
            if not isinstance(tid, str) or not isinstance(hello.get("mac"), str):
                raise ValueError("transfer and mac must be strings")
            if source is not None and not isinstance(source, str):
                raise ValueError("source must be a string")
            if not isinstance(header, dict) or not all(isinstance(k, str) and type(v) is int for k, v in header.items()):
                raise ValueError("sessions must map session ids to KV token counts")
            if len(header) > MAX_HEADER_SESSIONS:
                raise ValueError("too many sessions in the header")
        except Exception:  # noqa: BLE001 - whatever the bytes are (JSON nested too deep included): refused
            return 400, _err("bad link hello")
        if not hmac.compare_digest(hello["mac"], link_mac(self.token, challenge, tid)):
            return 401, _err("link authentication failed")
        try:
            self.check_id(tid, "transfer id")
            for sid in header:
                self.check_id(sid, "session id")
        except Exception as e:  # noqa: BLE001 - refused before any frame is read
            return self.classify(e)[0], _err(self.classify(e)[1])
        cut, got = self.cut, [0]

        def go_on() -> None:  # the round is open here: the source may send
            conn.sendall(_reply_bytes(GO_ON, {}))
            conn.settimeout(idle_timeout())  # a source silent this long has cut the round

        def read_into(view: memoryview) -> int:
            try:
                k = conn.recv_into(view)
            except OSError:  # a timeout, a reset
                raise cut() from None
            if not k:
                raise cut()  # the manifest ends a round: an end before it is a cut
            got[0] += k
            return k

        assert self._loop is not None
        # the round's span continues the source's export (as the HTTP import route's does)
        with continued_span("LINK /v1/sessions/import", hello.get("traceparent"), transfer=tid, final=final) as sp:
            try:
                status, body = 200, self.import_round(tid, read_into, final, source, header, self._loop, go_on)
            except self.cut:
                status, body = 0, {}  # the source cut the round: nobody reads an answer
            except Exception as e:  # noqa: BLE001 - refused: the source is told why, as over HTTP
                status, msg = self.classify(e)
                body = _err(msg)
            sp.set_attribute("relayout.bytes", got[0])
            sp.set_attribute("relayout.status", status)
        return status, body

    async def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def _drain(conn: socket.socket, limit_s: float = 5.0) -> None:
    """Read and drop what the source still sends (for up to `limit_s`), then close: closing with
    unread bytes would reset the connection and the source could lose the answer."""
    deadline = time.monotonic() + limit_s
    buf = bytearray(1 << 20)
    try:
        conn.shutdown(socket.SHUT_WR)
        while (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            if not conn.recv_into(buf):
                return
    except OSError:
        pass


def _err(msg: str) -> dict:
    return {"error": {"message": msg}}


class _OtherVersion(Exception):
    """The target's link speaks another version of the wire."""


class _NotConnected(Exception):
    """Nobody listens at the link's address (e.g. a cached one, the target restarted since)."""


class TcpTransport:
    """Pushes a round over the target's frame link (see the module docstring), from a thread that
    writes each frame piece as the round's producer hands it over; https targets, which the raw
    link would not encrypt, go over `fallback` (HTTP)."""

    def __init__(self, token: str | None, fallback, push_failed: type[Exception]):
        self.token, self.fallback, self.failed = token, fallback, push_failed
        # target URL -> its link, as its last round found it: a round, the final one above all (part of
        # the stall), need not ask again; any failure forgets it
        self.links: dict[str, LinkAddress] = {}

    async def _address(self, target: str) -> LinkAddress | None:
        """The target's link (None: it has none, it is older than the link: push over HTTP)."""
        if target in self.links:
            return self.links[target]
        try:
            async with httpx.AsyncClient(verify=tls_context(), timeout=30.0) as c:
                resp = await c.get(f"{target.rstrip('/')}{LINK_PATH}", headers=bearer_headers(self.token))
        except httpx.TransportError as e:
            raise self.failed(f"target link: {type(e).__name__}: {e or 'no detail'}", True) from None
        if resp.status_code == 404:
            return None
        if resp.status_code >= 400:
            raise self.failed(f"target link: HTTP {resp.status_code}: {error_message(resp)}", False)
        addr = resp.json()
        port, host = addr.get("port"), addr.get("host") or urlsplit(target).hostname or "127.0.0.1"
        if not isinstance(port, int) or not isinstance(host, str):
            raise self.failed("target link: no port in the answer", False)
        self.links[target] = LinkAddress(host, port, addr.get("entries") is True, addr.get("header") is True)
        return self.links[target]

    async def push(self, target: str, transfer: str, frames: RoundFrames, *, final: bool, source: str | None,
                   timeout_s: float) -> dict:
        u = urlsplit(target)
        if u.scheme != "http":
            return await self.fallback.push(target, transfer, frames, final=final, source=source, timeout_s=timeout_s)
        stop = threading.Event()
        try:
            hello = inject({"transfer": transfer, "final": final, "source": source})  # + the export's traceparent
            while True:  # twice at most: a kept address nobody listens at any more is asked again
                cached = target in self.links
                addr = await self._address(target)
                options = frames.options
                if options is not None:  # chunk frames name their entries only for a target that places them
                    options.entries = bool(addr and addr.entries)
                if addr is None:  # a target older than the link: HTTP it is
                    return await self.fallback.push(target, transfer, frames, final=final, source=source,
                                                    timeout_s=timeout_s)
                # the round's header: the target reserves blocks for its sessions before their first chunk
                offered = addr.entries and addr.header and 0 < len(frames.header) <= MAX_HEADER_SESSIONS
                said = {**hello, "sessions": frames.header} if offered else hello
                try:
                    # a pre-copy round's sender (copying out of the pool, hashing, sending) is a pre-copy worker
                    status, body = await on_worker(self._push, addr.host, addr.port, said, frames.blocking(),
                                                   timeout_s, stop, background=frames.background)
                    break
                except _NotConnected:  # (nothing of the round was produced yet)
                    self.links.pop(target, None)
                    if not cached:
                        raise self.failed("target import: the link refused the connection", True) from None
                    # the target restarted since (another port): ask it again
                except _OtherVersion:  # (nothing of the round was produced yet) a target of another link version
                    self.links.pop(target, None)
                    if options is not None:
                        options.entries = False
                    return await self.fallback.push(target, transfer, frames, final=final, source=source,
                                                    timeout_s=timeout_s)
                except BaseException:
                    self.links.pop(target, None)
                    raise
        finally:
            stop.set()  # cancelled (the transfer ended): the sending thread stops at its next piece
            await frames.aclose()
        if status >= 400:
            self.links.pop(target, None)  # (a target rolled back to another build at the same address: ask again)
            msg = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
            raise self.failed(f"target import: HTTP {status}: {msg}", False)
        if not isinstance(body, dict):
            raise self.failed("target import: the answer is not a JSON object", False)
        return body

    def _push(self, host: str, port: int, hello: dict, pieces: Iterator[bytes], timeout_s: float,
              stop: threading.Event) -> tuple[int, object]:
        try:
            try:
                sock = socket.create_connection((host, port), timeout=timeout_s)
            except ConnectionRefusedError:
                raise _NotConnected() from None
            with sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                head = _recv_exact(sock, len(LINK_MAGIC) + CHALLENGE_BYTES)
                if not head.startswith(LINK_MAGIC):
                    raise _OtherVersion()
                hello = {**hello, "mac": link_mac(self.token, head[len(LINK_MAGIC):], hello["transfer"])}
                data = json.dumps(hello).encode()
                sock.sendall(_LEN.pack(len(data)) + data)
                status, body = _read_reply(sock)
                if status != GO_ON:
                    return status, body
                for batch in _batches(pieces):
                    if stop.is_set():
                        raise ConnectionError("the round was cancelled")
                    # the target answers early only to refuse the round: its answer wins
                    if select.select([sock], [], [], 0)[0]:
                        break
                    _send_all(sock, batch)
                return _read_reply(sock)
        except (self.failed, _OtherVersion, _NotConnected):
            raise
        except (OSError, ConnectionError) as e:  # refused, reset, timed out: the link failed, the round may resume
            raise self.failed(f"target import: {type(e).__name__}: {e or 'no detail'}", True) from None
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()
