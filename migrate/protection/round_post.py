"""A protection's rounds as POSTs over one kept-alive HTTP/1.1 connection (h11 on an asyncio stream).

A protection sends a round every few decode steps, from the source's own cores, where each
microsecond is taken from decoding: httpx's client spent ~0.37 ms of CPU a POST (client side, on
loopback, the URL parsed once), h11 over a connection kept open ~0.06 ms. Only this one route
goes this way; every other call keeps httpx. The standby's HTTP front end is unchanged, and a
partition, a refused connection or a dead standby surface as they did (an exception, or the
standby's error response), so the lease decides what happens next (migrate.protection.replication).
Environment proxies are not consulted (a standby is reached directly, as the frame link reaches a
target).
"""

from __future__ import annotations

import asyncio

import h11
import httpx
from relayout.engine.web import tls_context

READ_BYTES = 1 << 16


class RoundPoster:
    """POST bodies to one URL over a connection kept between calls; opened on first use and again
    after any failure. Not for concurrent use: a protection sends one round at a time."""

    def __init__(self, url: httpx.URL, headers: httpx.Headers, connect_s: float, read_s: float) -> None:
        if url.scheme not in ("http", "https"):
            raise ValueError(f"a round goes over http or https, not {url.scheme!r}")
        self.url, self.connect_s, self.read_s = url, connect_s, read_s
        self.tls = tls_context() if url.scheme == "https" else None  # the process's one context
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.target = url.raw_path  # path and query, as sent
        self.headers = [(b"host", url.netloc), *((k.lower(), v) for k, v in headers.raw)]
        self._open: tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection] | None = None
        self._answered = False  # a byte of the current response came back: the round reached the standby

    async def post(self, body: bytes) -> httpx.Response:
        """The standby's response (any status). Raises on a connection that fails or times out; a
        kept connection the server closed while idle is retried once on a new one."""
        while True:
            reused = self._open is not None
            if self._open is None:
                r, w = await asyncio.wait_for(
                    asyncio.open_connection(self.url.host, self.port, ssl=self.tls,
                                            server_hostname=self.url.host if self.tls else None),
                    self.connect_s)
                self._open = (r, w, h11.Connection(h11.CLIENT))
            self._answered = False
            try:
                return await asyncio.wait_for(self._exchange(body), self.read_s)
            except (ConnectionError, EOFError, h11.RemoteProtocolError):
                self.close()
                if not reused or self._answered:
                    raise
            except BaseException:
                self.close()
                raise

    async def _exchange(self, body: bytes) -> httpx.Response:
        assert self._open is not None
        reader, writer, conn = self._open
        head = h11.Request(method=b"POST", target=self.target,
                           headers=[*self.headers, (b"content-length", str(len(body)).encode())])
        writer.write(conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        status, headers, chunks = 0, [], []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(READ_BYTES)
                if not data:
                    raise EOFError("the standby closed the connection")
                self._answered = True
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, list(event.headers)
            elif isinstance(event, h11.Data):
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()  # kept for the next round
                else:  # e.g. the standby said "Connection: close"
                    self.close()
                return httpx.Response(status, headers=headers, content=b"".join(chunks))
            elif isinstance(event, h11.ConnectionClosed):
                raise EOFError("the standby closed the connection")

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None
