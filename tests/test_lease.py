"""Protection's lease arithmetic: the source fences ahead of its lease's end by the step under way,
so its sessions are paused before the standby may promote them; and the bench's paced bare copy."""

from __future__ import annotations

import pytest
from relayout.migrate.protection.replication import LEASE_S, WATCH_S, ProtectConfig, Replicator
from relayout.migrate.protection.standby import PROMOTE_MARGIN_S, promote_after


def _replicator(lease_s: float, step_s: float) -> Replicator:
    cfg = ProtectConfig("http://127.0.0.1:1", "http://127.0.0.1:2", lease_s=lease_s)
    return Replicator("prot-x", cfg, ops=None, progress=dict, step_s=lambda: step_s)  # type: ignore[arg-type]


@pytest.mark.parametrize("lease_s", [0.2, LEASE_S, 1.0, 30.0])
@pytest.mark.parametrize("step_s", [0.0, 0.01, 0.05, 0.2, 5.0])
def test_sessions_are_paused_before_the_standby_may_promote(lease_s: float, step_s: float) -> None:
    ahead = _replicator(lease_s, step_s).fence_ahead_s()
    assert 0 < ahead <= lease_s / 2  # never fenced at once: a round must have a chance to renew it
    # the source's sessions are paused by: its look at the lease (WATCH_S) and the step under way,
    # counted from `ahead` before the lease's end; the standby waits the lease plus the margin
    paused_after_end = max(0.0, WATCH_S + step_s - ahead)
    if WATCH_S + 2 * step_s <= lease_s / 2:  # steps short against the lease: paused by its end
        assert paused_after_end == 0
    else:  # a step longer than a quarter of the lease: the fence may end after it (the margin's case)
        assert ahead == pytest.approx(lease_s / 2)
    assert promote_after(lease_s) == pytest.approx(lease_s + PROMOTE_MARGIN_S)


def test_a_fenced_ahead_lease_still_leaves_a_failover_under_a_second() -> None:
    # the default: promotion 0.75 s after the last round, a round every few tens of ms
    assert promote_after(LEASE_S) <= 0.8


def test_paced_bare_copy_moves_no_more_than_its_rate() -> None:
    from relayout.bench.replica_client import link_copy

    mbps, seconds = 8.0, 1.0
    cp = link_copy(256 << 20, mbps=mbps, seconds=seconds)
    moved = cp.gbps * 1e9 * (cp.ended - cp.started)
    assert 0 < moved <= mbps * 1e6 * seconds * 1.2 + (128 << 10)  # (one piece ahead of the pace at most)
    fast = link_copy(64 << 20)  # unpaced, the same bytes' worth of time: far more than the paced rate
    assert fast.gbps * 1e3 > 4 * mbps
