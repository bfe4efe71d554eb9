"""migrate.protection.round_post.RoundPoster against a real uvicorn server on loopback: a protection's rounds
reuse one connection, survive the server closing it while idle, and hand back error responses as
they came."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from relayout.engine.ranks.rank_channel import free_port
from relayout.migrate.protection.round_post import RoundPoster


@pytest.fixture(scope="module")
def server():
    app = FastAPI()
    peers: list[int] = []

    @app.post("/rounds")
    async def rounds(request: Request, n: int = 0):
        body = await request.body()
        peers.append(request.client.port if request.client else -1)
        if body == b"refuse":
            return JSONResponse({"error": {"type": "state_gap", "message": "no"}}, status_code=409)
        return {"bytes": len(body), "n": n, "auth": request.headers.get("authorization")}

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=1))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", peers
    srv.should_exit = True
    t.join(10)


def test_rounds_share_a_connection_and_outlive_its_idle_close(server) -> None:
    url, peers = server

    async def go() -> None:
        p = RoundPoster(httpx.URL(f"{url}/rounds?n=7"), httpx.Headers({"Authorization": "Bearer t"}), 2.0, 10.0)
        try:
            bodies = [b"x" * 100_000, b"y", b""]
            got = [await p.post(b) for b in bodies]
            assert [r.status_code for r in got] == [200, 200, 200]
            assert [r.json() for r in got] == [{"bytes": len(b), "n": 7, "auth": "Bearer t"} for b in bodies]
            assert len(set(peers[-3:])) == 1  # one connection, kept
            await asyncio.sleep(1.6)  # the server closes it after 1 s idle: the next round opens another
            r = await p.post(b"z")
            assert r.status_code == 200 and r.json()["bytes"] == 1 and peers[-1] != peers[-2]
            refused = await p.post(b"refuse")  # an error response comes back as it is, the connection kept
            assert refused.status_code == 409 and refused.json()["error"]["type"] == "state_gap"
            assert (await p.post(b"ok")).status_code == 200 and peers[-1] == peers[-2]
        finally:
            p.close()

    asyncio.run(go())


def test_a_dead_standby_is_an_error_not_a_hang() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go() -> None:
        p = RoundPoster(httpx.URL(f"http://127.0.0.1:{port}/rounds"), httpx.Headers(), 1.0, 1.0)
        with pytest.raises(OSError):
            await p.post(b"x")

    asyncio.run(go())
    with pytest.raises(ValueError, match="http or https"):
        RoundPoster(httpx.URL("ftp://127.0.0.1/rounds"), httpx.Headers(), 1.0, 1.0)
