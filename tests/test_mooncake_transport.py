"""The Mooncake transport (`"transport": "mooncake"` on the export, `MigrationPlan(transport=…)`): real
replica processes, the source writes each round into the target's registered ring over Mooncake's
transfer engine; the sessions finish on the target with the tokens of an undisturbed run, and the
rings are unregistered afterwards. Without Mooncake (the package, or the system's libibverbs1) the
migration test is skipped; asking for it then is a clear 400, checked everywhere by switching
Mooncake off in a launched replica (RELAYOUT_MOONCAKE_DISABLED=1)."""

from __future__ import annotations

import httpx
import pytest
from relayout.migrate.protocol.live import MigrationError, MigrationPlan, migrate_live
from relayout.migrate.transport.mooncake import DISABLE_ENV, MOONCAKE_PATH, unavailable

from tests.helpers.migration import Moved, finish_moved, idle, reference, replica_pair, streams_on

TOKEN = "mooncake-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODIES = [dict(prompt=f"mooncake {i}: " + "the five boxing wizards jump quickly " * (30 + 10 * i), max_tokens=240,
               ignore_eos=True, **({"temperature": 0.7, "seed": 5 + i} if i % 2 else {"temperature": 0.0}))
          for i in range(2)]
WHY = unavailable()


def _pair(env: dict):
    return replica_pair((None, env), ("attn_tp=2", env))


@pytest.fixture(scope="module")
def pair():
    if WHY:
        pytest.skip(f"Mooncake is not usable here: {WHY}")
    with _pair({"RELAYOUT_TOKEN": TOKEN, "RELAYOUT_MOONCAKE_BUFFER_MB": "1"}) as procs:  # a small ring: it wraps many times
        yield procs


def test_live_migration_over_mooncake(pair):
    a, b = (p.url for p in pair)
    refs = [reference(b, body) for body in BODIES]
    m = Moved(streams_on(a, BODIES, [b]))
    m.result = res = migrate_live(a, b, token=TOKEN, plan=MigrationPlan(small_bytes=0, max_rounds=2, timeout_s=60,
                                                                     transport="mooncake"))
    assert max(r.bytes for r in res.rounds) > 1 << 20 and res.sessions, res  # a round wrapped the 1 MiB ring
    finish_moved(m, refs, b, a)
    idle(a)
    idle(b)
    # no round is open any more: its ring was unregistered
    r = httpx.post(f"{b}{MOONCAKE_PATH}/segment", params={"transfer": res.transfer_id, "seq": 0, "slot": 0,
                                                            "length": 1}, headers=AUTH, timeout=10)
    assert r.status_code == 404


def test_ring_is_writable_only_during_its_round(pair):
    """Mooncake authenticates nobody: the ring is registered from `open` to the round's end only, and
    bytes written there by anyone are checked by the import (here: refused, bad magic)."""
    import ctypes
    import mmap

    from mooncake.engine import TransferEngine

    b = pair[1].url
    peer = httpx.post(f"{b}{MOONCAKE_PATH}/open", params={"transfer": "t-ring"}, headers=AUTH, timeout=30).json()
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    mem = mmap.mmap(-1, 1 << 20)
    mem[:16] = b"XXXX" + bytes(12)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    assert e.register_memory(addr, 1 << 20) == 0
    assert e.transfer_sync_write(peer["session"], addr, peer["addr"], 4096) == 0  # open: anyone may write
    r = httpx.post(f"{b}{MOONCAKE_PATH}/segment", params={"transfer": "t-ring", "seq": 0, "slot": 0, "length": 16},
                   headers=AUTH, timeout=30)
    if r.status_code == 200:  # taken; the refusal comes with the end
        r = httpx.post(f"{b}{MOONCAKE_PATH}/end", params={"transfer": "t-ring"}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "magic" in r.json()["error"]["message"], r.text
    assert e.transfer_sync_write(peer["session"], addr, peer["addr"], 4096) != 0  # unregistered once the round ended
    assert httpx.get(f"{b}/v1/sessions/transfers/t-ring", headers=AUTH).json()["incoming"] in (None, "aborted")
    e.unregister_memory(addr)


def test_mooncake_routes_need_the_token(pair):
    r = httpx.post(f"{pair[1].url}{MOONCAKE_PATH}/open", params={"transfer": "t-noauth"}, timeout=10)
    assert r.status_code == 401


@pytest.fixture(scope="module")
def without_mooncake():
    with _pair({"RELAYOUT_TOKEN": TOKEN, DISABLE_ENV: "1"}) as procs:
        yield procs


def test_mooncake_unavailable_is_a_clear_400(without_mooncake):
    a, b = (p.url for p in without_mooncake)
    r = httpx.post(f"{a}/v1/sessions/export", json={"transfer": "t-nomooncake", "target": b, "transport": "mooncake"},
                   headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "mooncake is not available" in msg and DISABLE_ENV in msg, msg
    # nothing was started on the source for it
    assert httpx.get(f"{a}/v1/sessions/transfers/t-nomooncake", headers=AUTH).json()["outgoing"] is None
    # the target's own route says the same
    r = httpx.post(f"{b}{MOONCAKE_PATH}/open", params={"transfer": "t-nomooncake"}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "not available on the target" in r.json()["error"]["message"]
    # an unknown transport is refused by the body's schema
    r = httpx.post(f"{a}/v1/sessions/export", json={"transfer": "t-x", "target": b, "transport": "carrier-pigeon"},
                   headers=AUTH, timeout=30)
    assert r.status_code in (400, 422)
    # through migrate_live: the migration fails before anything moved, and says why
    s = streams_on(a, BODIES[:1], [b])
    with pytest.raises(MigrationError, match="mooncake is not available"):
        migrate_live(a, b, token=TOKEN, plan=MigrationPlan(small_bytes=0, max_rounds=1, timeout_s=30,
                                                             transport="mooncake"))
    s[0].join(120)
    assert s[0].error is None and s[0].owners[-1] == a
    idle(a)
    idle(b)


def test_unavailable_names_the_missing_piece(monkeypatch):
    """What the 400 says: the package missing, or the system's libibverbs missing (the import's own text)."""
    import builtins

    real = builtins.__import__
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    for err, expect in ((ModuleNotFoundError("No module named 'mooncake'"), "relayout[mooncake]"),
                        (ImportError("libibverbs.so.1: cannot open shared object file"), "apt-get install libibverbs1")):
        def fake(name, *a, _err=err, **kw):
            if name.startswith("mooncake"):
                raise _err
            return real(name, *a, **kw)

        monkeypatch.setattr(builtins, "__import__", fake)
        assert expect in (unavailable() or "")
        monkeypatch.setattr(builtins, "__import__", real)
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert DISABLE_ENV in (unavailable() or "")
