"""The raw frame link (the default transport, tcp): real replica processes, the source pushes each
round over TCP; sessions finish on the target unchanged, a connection with a wrong MAC is refused, a
connection cut inside a round keeps what arrived (a resume sends only the rest), and the network
faults of the fault matrix (a cut, a stall, garbled bytes) through a proxy on the link itself."""

from __future__ import annotations

import json
import socket
import struct
import threading

import httpx
import pytest
from relayout.engine.ranks.rank_channel import free_port
from relayout.migrate.protocol.live import MigrationError, MigrationPlan, migrate_live
from relayout.migrate.transport.frame_link import (
    CHALLENGE_BYTES,
    LINK_MAGIC,
    LINK_PATH,
    LinkAddress,
    link_mac,
)

from tests.helpers.migration import (
    Moved,
    finish,
    finish_moved,
    idle,
    migrate_with_streams,
    reference,
    replica_pair,
    streams_on,
)
from tests.helpers.proxy import Proxy

TOKEN = "link-secret"
ENV = {"RELAYOUT_TRANSPORT": "tcp", "RELAYOUT_TOKEN": TOKEN}
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODIES = [dict(prompt="link: " + "sphinx of black quartz judge my vow " * 30, max_tokens=320, ignore_eos=True,
               temperature=0.0)]


@pytest.fixture(scope="module")
def pair():
    with replica_pair((None, ENV), ("attn_tp=2", ENV)) as procs:
        yield procs


def _connect(url: str) -> tuple[socket.socket, bytes]:
    port = httpx.get(f"{url}{LINK_PATH}", headers=AUTH, timeout=10).json()["port"]
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = b""
    while len(head) < len(LINK_MAGIC) + CHALLENGE_BYTES:
        head += s.recv(64)
    assert head.startswith(LINK_MAGIC)
    return s, head[len(LINK_MAGIC):]


def _hello(s: socket.socket, tid: str, mac: str) -> None:
    h = json.dumps({"transfer": tid, "final": False, "mac": mac}).encode()
    s.sendall(struct.pack(">I", len(h)) + h)


def _one_reply(s: socket.socket) -> tuple[int, dict]:
    """One reply, without waiting for the connection to end (the go-ahead after a good hello)."""
    data = b""
    while len(data) < 8 or len(data) < 8 + struct.unpack(">II", data[:8])[1]:
        got = s.recv(65536)
        assert got, "the target closed the link"
        data += got
    status, n = struct.unpack(">II", data[:8])
    return status, json.loads(data[8:8 + n])


def _reply(s: socket.socket) -> tuple[int, dict]:
    data = b""
    while True:
        got = s.recv(65536)
        if not got:
            break
        data += got
    status, n = struct.unpack(">II", data[:8])
    return status, json.loads(data[8:8 + n])


def test_link_port_needs_the_token(pair):
    assert httpx.get(f"{pair[1].url}{LINK_PATH}", timeout=10).status_code == 401


def test_wrong_mac_is_refused(pair):
    s, challenge = _connect(pair[1].url)
    _hello(s, "t-badmac", link_mac("not-the-token", challenge, "t-badmac"))
    status, body = _reply(s)
    assert status == 401 and "authentication" in body["error"]["message"]
    assert httpx.get(f"{pair[1].url}/v1/sessions/transfers/t-badmac", headers=AUTH).json()["incoming"] is None


def test_a_hostile_hello_is_refused_and_the_link_serves_on(pair):
    """The acceptor reads every hello before any worker sees it: no hello, however built (JSON nested too
    deep for the parser, a header naming ids that are not ids, too long), ends it: each gets its
    answer, and the next connection its challenge."""
    s, _ = _connect(pair[1].url)
    hello = b"[" * 200_000
    s.sendall(struct.pack(">I", len(hello)) + hello)
    status, body = _reply(s)
    assert status == 400 and body["error"]["message"] == "bad link hello"
    for sessions, why in (([1], "bad link hello"), ({"s": "5"}, "bad link hello"), ({"../etc": 5}, "session id")):
        s, challenge = _connect(pair[1].url)  # (signed: the header is the only thing wrong)
        _hello_with(s, {"transfer": "t-h", "final": False, "mac": link_mac(TOKEN, challenge, "t-h"),
                        "sessions": sessions})
        status, body = _reply(s)
        assert status == 400 and why in body["error"]["message"], (sessions, status, body)
    s, _ = _connect(pair[1].url)
    s.sendall(struct.pack(">I", (1 << 20) + 1))
    status, body = _reply(s)
    assert status == 400 and "too large" in body["error"]["message"]
    s, challenge = _connect(pair[1].url)  # still accepting, still answering
    _hello(s, "t-after", link_mac("not-the-token", challenge, "t-after"))
    assert _reply(s)[0] == 401


def _hello_with(s: socket.socket, hello: dict) -> None:
    h = json.dumps(hello).encode()
    s.sendall(struct.pack(">I", len(h)) + h)


def test_garbage_is_refused_and_a_cut_is_kept(pair):
    b = pair[1].url
    s, challenge = _connect(b)
    _hello(s, "t-garbage", link_mac(TOKEN, challenge, "t-garbage"))
    assert _one_reply(s)[0] == 100  # go on
    s.sendall(b"XXXX" + bytes(12))
    status, body = _reply(s)
    assert status == 400 and "magic" in body["error"]["message"]
    # a round cut before its manifest stays open on the target (resumable), not refused
    s, challenge = _connect(b)
    _hello(s, "t-cut", link_mac(TOKEN, challenge, "t-cut"))
    assert _one_reply(s)[0] == 100
    s.sendall(b"RLC1")
    s.close()
    st = httpx.get(f"{b}/v1/sessions/transfers/t-cut", headers=AUTH).json()
    for _ in range(50):
        if st["incoming"] is not None:
            break
        st = httpx.get(f"{b}/v1/sessions/transfers/t-cut", headers=AUTH).json()
    assert st["incoming"] == "receiving", st
    httpx.delete(f"{b}/v1/sessions/transfers/t-cut", headers=AUTH)


def test_live_migration_over_the_link(pair):
    a, b = (p.url for p in pair)
    refs = [reference(b, body) for body in BODIES]
    m = Moved(streams_on(a, BODIES, [b]))
    m.result = res = migrate_live(a, b, token=TOKEN, plan=MigrationPlan(small_bytes=0, max_rounds=2, timeout_s=60))
    assert res.bytes_total > 0 and res.sessions
    finish_moved(m, refs, b, a)
    idle(a)
    idle(b)


# ---- the fault matrix's network faults, on the frame link (tests/test_faults.py injects them on HTTP) ----
# long enough to be still running when a retried round completes (192 tokens stopped being enough once
# sampling stopped costing ~0.3 ms a token: every session finished before the final round, none moved)
FAULT_BODIES = [dict(prompt=f"link fault {i}: " + "the quick brown fox " * (8 + 3 * i), max_tokens=384,
                     ignore_eos=True, **({"temperature": 0.8, "seed": 7 + i} if i % 2 else {"temperature": 0.0}))
                for i in range(2)]


@pytest.fixture(scope="module")
def linked():
    """Source a, target b whose frame link sources reach through a fault-injecting proxy (b advertises
    the proxy's address: RELAYOUT_LINK_ADVERTISE); b treats a link silent for 2 s as cut."""
    link_port = free_port()
    px = Proxy(link_port)
    env_b = {**ENV, "RELAYOUT_LINK_PORT": str(link_port), "RELAYOUT_LINK_ADVERTISE": f"127.0.0.1:{px.port}",
             "RELAYOUT_LINK_IDLE_S": "2", "RELAYOUT_TRANSFER_TTL_S": "2"}
    try:
        with replica_pair((None, {**ENV, "RELAYOUT_TRANSFER_TTL_S": "2"}), (None, env_b)) as procs:
            a, b = (p.url for p in procs)
            yield a, b, px, [reference(b, body) for body in FAULT_BODIES]
    finally:
        px.close()


def test_link_cut_mid_round_resumes_from_acknowledged_chunks(linked):
    a, b, px, refs = linked
    m = migrate_with_streams(a, b, [b], FAULT_BODIES, arm=lambda: px.arm("cut", after=30_000), max_rounds=2,
                             timeout_s=30, token=TOKEN)
    assert px.fired.is_set() and m.result.retries >= 1
    finish_moved(m, refs, b, a)
    idle(a)
    idle(b)


def test_link_stalled_sessions_stay_on_source(linked):
    a, b, px, refs = linked
    m = migrate_with_streams(a, b, [b], FAULT_BODIES, arm=lambda: px.arm("stall", after=20_000), raises=MigrationError,
                             match="pre-copy", timeout_s=2, retries=0, token=TOKEN)
    assert px.fired.is_set() and m.seconds < 20
    assert "continue on the source" in str(m.error)
    px.heal()
    finish(m.streams, refs, a)
    idle(b, timeout=15)


def test_link_garbled_frames_refused_by_target(linked):
    a, b, px, refs = linked
    m = migrate_with_streams(a, b, [b], FAULT_BODIES, arm=lambda: px.arm("garble", after=40_000), raises=MigrationError,
                             match="pre-copy", timeout_s=10, retries=0, token=TOKEN)
    assert px.fired.is_set() and "continue on the source" in str(m.error)
    assert any(w in str(m.error) for w in ("HTTP 400", "reset", "closed")), m.error
    finish(m.streams, refs, a)
    idle(b, timeout=15)


def test_a_link_of_another_version_falls_back_to_http():
    """A target whose link speaks another wire version (here a listener that greets with "RLK1", as
    0.4.0's did): the source pushes over HTTP instead, and the sessions move unchanged."""
    old = socket.create_server(("127.0.0.1", 0))
    greeted = []

    def greet() -> None:
        while True:
            try:
                conn, _ = old.accept()
            except OSError:
                return
            greeted.append(1)
            conn.sendall(b"RLK1" + bytes(CHALLENGE_BYTES))
            conn.close()

    threading.Thread(target=greet, daemon=True).start()
    env_b = {**ENV, "RELAYOUT_LINK_ADVERTISE": f"127.0.0.1:{old.getsockname()[1]}"}
    try:
        with replica_pair((None, ENV), (None, env_b)) as procs:
            a, b = (p.url for p in procs)
            refs = [reference(b, body) for body in FAULT_BODIES]
            m = migrate_with_streams(a, b, [b], FAULT_BODIES, max_rounds=2, timeout_s=30, token=TOKEN)
            assert greeted and m.result.bytes_total > 0
            finish_moved(m, refs, b, a)
    finally:
        old.close()


def test_the_link_address_is_asked_once_and_asked_again_when_it_moved():
    """The source asks a target for its link's address once (not each round, the final one being
    part of the stall) and asks again when nobody listens there any more (the target restarted)."""
    import asyncio
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from relayout.migrate.transport.base import ROUND_WORKERS, RoundFrames
    from relayout.migrate.transport.frame_link import GO_ON, TcpTransport, _reply_bytes

    link = socket.create_server(("127.0.0.1", 0))
    asked, rounds = [], []

    class Ask(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            asked.append(self.path)
            body = json.dumps({"port": link.getsockname()[1]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    def serve_link() -> None:
        while True:
            try:
                conn, _ = link.accept()
            except OSError:
                return
            with conn:
                conn.sendall(LINK_MAGIC + bytes(CHALLENGE_BYTES))
                (n,) = struct.unpack(">I", conn.recv(4))
                hello = json.loads(conn.recv(n))
                conn.sendall(_reply_bytes(GO_ON, {}))
                got = b""
                while len(got) < 6:
                    got += conn.recv(6 - len(got))
                rounds.append((hello["transfer"], got))
                conn.sendall(_reply_bytes(200, {"sessions": []}))

    http = ThreadingHTTPServer(("127.0.0.1", 0), Ask)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    threading.Thread(target=serve_link, daemon=True).start()
    target = f"http://127.0.0.1:{http.server_address[1]}"
    t = TcpTransport(None, fallback=None, push_failed=RuntimeError)
    dead = free_port()  # where the link was before the target restarted: nobody listens
    t.links[target] = LinkAddress("127.0.0.1", dead, False)

    async def push(tid: str) -> dict:
        return await t.push(target, tid, RoundFrames(iter([b"abc", b"def"])), final=False, source=None, timeout_s=10)

    try:
        assert asyncio.run(push("t1")) == {"sessions": []}
        assert len(asked) == 1 and asked[0] == LINK_PATH, "a refused cached address is asked again"
        assert t.links[target][:2] == ("127.0.0.1", link.getsockname()[1])
        assert asyncio.run(push("t2")) == {"sessions": []}
        assert len(asked) == 1, "a known address is not asked again"
        # a round starts no thread: its sender and its producer run on kept round workers
        end = time.monotonic() + 10
        while ROUND_WORKERS.busy and time.monotonic() < end:
            time.sleep(0.01)
        threads, jobs = ROUND_WORKERS.started, ROUND_WORKERS.submitted
        assert asyncio.run(push("t3")) == {"sessions": []}
        assert ROUND_WORKERS.submitted >= jobs + 2 and ROUND_WORKERS.started == threads
        assert rounds == [("t1", b"abcdef"), ("t2", b"abcdef"), ("t3", b"abcdef")]
    finally:
        http.shutdown()
        link.close()
