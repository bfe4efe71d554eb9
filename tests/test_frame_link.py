"""The raw frame link (RELAYOUT_TRANSPORT=tcp): real replica processes, the source pushes each round
over TCP; sessions finish on the target unchanged, a connection with a wrong MAC is refused, and
a connection cut inside a round keeps what arrived (a resume sends only the rest)."""

from __future__ import annotations

import json
import socket
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from relayout.migrate.frame_link import CHALLENGE_BYTES, LINK_MAGIC, LINK_PATH, link_mac
from relayout.migrate.live import migrate_live
from relayout.migrate.procs import replica

from tests.migration_helpers import Moved, finish_moved, idle, reference, streams_on

TOKEN = "link-secret"
ENV = {"RELAYOUT_TRANSPORT": "tcp", "RELAYOUT_TOKEN": TOKEN}
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODIES = [dict(prompt="link: " + "sphinx of black quartz judge my vow " * 30, max_tokens=320, ignore_eos=True,
               temperature=0.0)]


@pytest.fixture(scope="module")
def pair():
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(replica, None, ENV), pool.submit(replica, "attn_tp=2", ENV)]
        procs = [f.result() for f in futs]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


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
    m.result = res = migrate_live(a, b, small_bytes=0, max_rounds=2, timeout_s=60, token=TOKEN)
    assert res.bytes_total > 0 and res.sessions
    finish_moved(m, refs, b, a)
    idle(a)
    idle(b)
