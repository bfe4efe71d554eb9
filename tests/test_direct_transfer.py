"""The KV of a live migration goes straight from the source replica to the target replica: the
migrator (migrate_live) only coordinates. A counting proxy sits on the migrator's own connections
to both replicas (and on nothing else); they carry less than 1% of the KV bytes moved, and the
sessions finish on the target with exactly the tokens of an undisturbed run."""

from __future__ import annotations

import pytest
from relayout.migrate.protocol.live import MigrationPlan, migrate_live

from tests.helpers.migration import Moved, finish_moved, idle, port_of, reference, replica_pair, streams_on
from tests.helpers.proxy import Proxy

# long prompts: the KV moved dwarfs the control messages, as in any real migration; long outputs: still
# decoding when the final round comes on a fast machine (a session that finished first moves nothing)
BODIES = [dict(prompt=f"direct {i}: " + "pack my box with five dozen liquor jugs " * (40 + 10 * i), max_tokens=320,
               ignore_eos=True, **({"temperature": 0.7, "seed": 11 + i} if i % 2 else {"temperature": 0.0}))
          for i in range(3)]


@pytest.fixture(scope="module")
def pair():
    with replica_pair((None, None), ("attn_tp=2", None)) as procs:
        yield procs


def test_migrator_connections_carry_no_kv(pair):
    a, b = (p.url for p in pair)
    refs = [reference(b, body) for body in BODIES]
    to_a, to_b = Proxy(port_of(a)), Proxy(port_of(b))
    try:
        m = Moved(streams_on(a, BODIES, [b]))  # the clients talk to the replicas directly
        # the migrator reaches both replicas only through the proxies; the replicas reach each other directly
        res = m.result = migrate_live(to_a.url, to_b.url, plan=MigrationPlan(
            small_bytes=0, max_rounds=3, timeout_s=60, source_for_target=a, target_for_source=b))
        finish_moved(m, refs, b, a)
        assert res.bytes_total > 0 and res.sessions
        through_migrator = to_a.bytes_up + to_a.bytes_down + to_b.bytes_up + to_b.bytes_down
        assert through_migrator < 0.01 * res.bytes_total, (through_migrator, res.bytes_total)
    finally:
        to_a.close()
        to_b.close()
    idle(a)
    idle(b)


def test_push_target_must_be_a_replica_url(pair):
    """The source pushes only to an http(s) URL given by an authenticated caller."""
    import httpx

    a = pair[0].url
    r = httpx.post(f"{a}/v1/sessions/export", json={"transfer": "bad-target", "target": "file:///etc/passwd"})
    assert r.status_code == 400 and "URL" in r.json()["error"]["message"]
    assert httpx.get(f"{a}/v1/sessions/transfers/bad-target").json()["outgoing"] is None


def test_migrate_live_takes_where_what_and_a_plan():
    import dataclasses
    import inspect

    params = inspect.signature(migrate_live).parameters
    assert list(params)[:3] == ["source_url", "target_url", "sessions"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(params.values())[3:])
    assert {"target_for_source", "source_for_target", "transport", "transfer_id"} <= {
        f.name for f in dataclasses.fields(MigrationPlan)}
    with pytest.raises(ValueError, match="mode"):
        MigrationPlan(mode="warm")
    with pytest.raises(ValueError, match="timeout_s"):
        MigrationPlan(timeout_s=0)
