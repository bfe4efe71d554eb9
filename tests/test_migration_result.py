"""A live migration's result names exactly what moved (issue: one succeeded with `sessions: []` while
8 sessions ran): under a CPU hog beside the replicas, with sessions that finish on the source
around the cut, every session listed on the source is either in `sessions` (and runs on the
target) or in `not_moved` with the source's reason (and finished on the source); every stream
ends with the undisturbed tokens."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from relayout.migrate.protocol.live import MigrationPlan, migrate_live
from relayout.migrate.protocol.states import FINISHED_ON_SOURCE

from tests.helpers.migration import reference, replica_pair, replica_state, streams_on

pytestmark = pytest.mark.slow

HOG = "import time\nwhile True:\n    sum(range(10000))\n"


def test_result_lists_every_session_exactly_under_load():
    with replica_pair(("attn_dp=1", None), ("attn_tp=2", None)) as (src, dst):
        a, b = src.url, dst.url
        # two that outlive the move even while pre-copy (at nice 10) waits behind the hogs, six that end
        # around it (a few tokens after they start)
        bodies = [{"prompt": f"result {i}", "max_tokens": (3000 if i in (1, 4) else 8 + 3 * i), "temperature": 0.0,
                   "ignore_eos": True} for i in range(8)]
        with ThreadPoolExecutor(len(bodies)) as pool:  # the references decode side by side
            refs = list(pool.map(lambda body: reference(a, body), bodies))
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
        try:
            streams = streams_on(a, bodies, [b])
            listed = {s["id"] for s in replica_state(a)["sessions"]}
            res = migrate_live(a, b, sorted(listed), plan=MigrationPlan(small_bytes=0))
        finally:
            for h in hogs:
                h.kill()
        assert not set(res.sessions) & set(res.not_moved), res
        assert set(res.sessions) | set(res.not_moved) == listed, res
        assert res.sessions, (res.not_moved, [(r.bytes, round(r.seconds, 3)) for r in res.rounds])  # the long ones were running: they moved
        assert res.kept() == {}, res  # every one not moved had finished: the builtin engine keeps none
        assert set(res.not_moved.values()) <= {FINISHED_ON_SOURCE}, res
        for i, s in enumerate(streams):
            s.join(120)
            assert s.error is None and s.tokens == refs[i], i
            if s.sid in res.sessions:
                assert s.owners[-1] == b, (i, s.owners)
            else:  # finished at home (not listed: it ended before the migration looked)
                assert s.owners[-1] == a and replica_state(a) is not None, (i, s.owners)
