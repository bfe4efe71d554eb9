"""A loopback TCP proxy that cuts / slows / stalls / garbles a link after N bytes: the fault
injector of the reliability tests."""

from __future__ import annotations

import asyncio
import os
import threading


class Proxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<upstream>. Faults fire once `after` more bytes
    have gone client→upstream since `arm()`:
      cut        close both sides of every open connection (RST), then pass again
      partition  cut, and refuse every later connection until `heal()`
      stall      stop forwarding client→upstream bytes (the peer hangs)
      garble     flip bytes client→upstream from then on (one connection's worth)
      garbage    answer the next response with junk instead of the upstream's bytes
      slow       sleep `delay` seconds per forwarded piece (always, once armed)
    `on_fire()` is called when the fault fires (e.g. to kill -9 a process there).
    `bytes_up` / `bytes_down` count every byte forwarded each way (a counting proxy)."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.mode = "pass"
        self.after = 0
        self.delay = 0.0
        self.on_fire = None
        self.fired = threading.Event()
        self._up_total = 0
        self.bytes_down = 0
        self._fire_at: int | None = None
        self._partitioned = False
        self._garbage_pending = False
        self._writers: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    @property
    def bytes_up(self) -> int:
        return self._up_total

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start():
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]

        self.loop.run_until_complete(start())
        ready.set()
        self.loop.run_forever()

    def arm(self, mode: str, after: int = 0, delay: float = 0.0, on_fire=None) -> None:
        self.mode, self.after, self.delay, self.on_fire = mode, after, delay, on_fire
        self.fired.clear()
        self._fire_at = self._up_total + after

    def heal(self) -> None:
        self.mode, self._fire_at, self._partitioned, self._garbage_pending = "pass", None, False, False

    def close(self) -> None:
        async def shut():
            self.server.close()
            for w in list(self._writers):
                w.transport.abort()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()
            await asyncio.sleep(0.05)

        try:
            asyncio.run_coroutine_threadsafe(shut(), self.loop).result(5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)

    def _fire(self) -> None:
        self._fire_at = None
        self.fired.set()
        if self.on_fire:
            threading.Thread(target=self.on_fire, daemon=True).start()
        if self.mode in ("cut", "partition"):
            self._partitioned = self.mode == "partition"
            for w in list(self._writers):
                w.transport.abort()
            self.mode = "pass" if self.mode == "cut" else self.mode
        elif self.mode == "garbage":
            self._garbage_pending = True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._partitioned:
            writer.transport.abort()
            return
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, uw}

        async def up():
            while True:
                data = await reader.read(16384)
                if not data:
                    break
                if self.mode == "slow" and self._fire_at is not None and self._up_total >= self._fire_at:
                    await asyncio.sleep(self.delay)
                if self._fire_at is not None and self.mode != "slow" and self._up_total + len(data) > self._fire_at:
                    k = self._fire_at - self._up_total
                    mode = self.mode
                    if mode in ("cut", "partition"):
                        uw.write(data[:k])
                        self._up_total += k
                        self._fire()
                        return
                    if mode == "stall":
                        uw.write(data[:k])
                        self._up_total += k
                        self._fire()
                        await asyncio.sleep(3600)
                    if mode == "garble":
                        data = data[:k] + bytes(b ^ 0x5A for b in data[k:])
                        self._up_total += len(data)
                        self._fire()
                        uw.write(data)
                        while True:  # the rest of this connection is garbled too
                            data = await reader.read(16384)
                            if not data:
                                return
                            uw.write(bytes(b ^ 0x5A for b in data))
                    if mode == "garbage":
                        self._fire()
                self._up_total += len(data)
                uw.write(data)
                await uw.drain()

        async def down():
            while True:
                data = await ur.read(16384)
                if not data:
                    break
                if self._garbage_pending:
                    self._garbage_pending = False
                    self.mode = "pass"
                    writer.write(b"\x00\xffNOT HTTP AT ALL\r\n\r\n" + os.urandom(64))
                    await writer.drain()
                    writer.transport.abort()
                    return
                self.bytes_down += len(data)
                writer.write(data)
                await writer.drain()

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except Exception:  # noqa: BLE001
            pass
        finally:
            for t in tasks:
                t.cancel()
            for w in (writer, uw):
                self._writers.discard(w)
                try:
                    w.close()
                except Exception:  # noqa: BLE001
                    pass
