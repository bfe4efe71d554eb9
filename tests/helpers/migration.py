"""Clients for process-level migration tests: SSE streams that follow a session to whichever
replica ends up owning it (like the gateway), reference outputs, and polling helpers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pytest

# the same clients the soak bench uses: one copy, in relayout.bench.soak
from relayout.bench.soak import Stream, port_of, reference, replica_state, wait_for  # noqa: F401 - re-exported to the tests
from relayout.migrate.procs import Proc, replica
from relayout.migrate.protocol.live import MigrationPlan, MigrationResult, migrate_live
from relayout.storage.stores import MemoryStore


@dataclass
class Incoming:
    """What engine.moves.receive.receive_round keeps of one incoming transfer (engine.moves.receive.IncomingKV),
    for tests that drive rounds between engines in one process."""

    store: MemoryStore = field(default_factory=MemoryStore)
    blocks: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    upto: dict[str, int] = field(default_factory=dict)
    placed: list[str] = field(default_factory=list)


@contextmanager
def replica_pair(*specs: tuple[str | None, dict | None]) -> Iterator[list[Proc]]:
    """Replicas started side by side, one per (layout, env) spec, stopped on the way out."""
    with ThreadPoolExecutor(len(specs)) as pool:
        procs = [f.result() for f in [pool.submit(replica, layout, env) for layout, env in specs]]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


# ---- the arrange / migrate / finish shape of the fault tests ---------------------------------------
def streams_on(src: str, bodies: list[dict], follow: list[str]) -> list[Stream]:
    """One following stream per body on `src`, each started (tokens flowing)."""
    ss = [Stream(src, b, follow) for b in bodies]
    for s in ss:
        assert s.started.wait(60)
    return ss


@dataclass
class Moved:
    """What one arranged migration left: the streams, and the result or the error it ended with."""

    streams: list[Stream]
    result: MigrationResult | None = None
    error: BaseException | None = None
    seconds: float = 0.0


def migrate_with_streams(src: str, target: str, follow: list[str], bodies: list[dict], *,
                         arm: Callable[[], object] | None = None, raises: type[BaseException] | None = None,
                         match: str | None = None, token: str | None = None,
                         on_phase: Callable[[str], object] | None = None, **kw) -> Moved:
    """The shape of every migration fault: streams of `bodies` on `src` (followed to `follow`),
    then `arm()` (the fault), then migrate_live(src, target) under MigrationPlan(small_bytes=0, **kw), with
    `on_phase` observing its phases — which must raise `raises` (matching `match`) when given."""
    plan = MigrationPlan(**{"small_bytes": 0, **kw})
    m = Moved(streams_on(src, bodies, follow))
    if arm is not None:
        arm()
    t0 = time.time()
    if raises is None:
        m.result = migrate_live(src, target, token=token, plan=plan, on_phase=on_phase)
    else:
        with pytest.raises(raises, match=match) as ei:
            migrate_live(src, target, token=token, plan=plan, on_phase=on_phase)
        m.error = ei.value
    m.seconds = time.time() - t0
    return m


def finish(ss: list[Stream], refs: list[list[int]], where: str) -> None:
    """Every stream ended with the undisturbed tokens, last served by `where`."""
    for i, s in enumerate(ss):
        s.join(120)
        assert s.error is None, s.error
        assert s.tokens == refs[i], f"session {i} changed ({len(s.tokens)} tokens)"
        assert s.owners[-1] == where, (i, s.owners)


def unchanged(ss: list[Stream], refs: list[list[int]]) -> None:
    """Every stream ended with the undisturbed tokens, wherever it finished."""
    for i, s in enumerate(ss):
        s.join(120)
        assert s.error is None and s.tokens == refs[i]


def finish_moved(m: Moved, refs: list[list[int]], target: str, source: str) -> None:
    """Every stream ended with the undisturbed tokens; the moved sessions last served by `target`,
    the others (finished before the final round) by `source`."""
    assert m.result is not None and m.result.sessions
    for i, s in enumerate(m.streams):
        s.join(120)
        assert s.error is None and s.tokens == refs[i]
        assert s.owners[-1] == (target if s.sid in m.result.sessions else source), (i, s.owners)


def idle(url: str, timeout: float = 10) -> None:
    """No sessions and no KV blocks left on the replica (reservations included)."""
    st = wait_for(lambda: (lambda r: r if not r["sessions"] and r["kv_blocks_used"] == 0 else None)(replica_state(url)),
                  timeout)
    assert st, replica_state(url)


def no_transfers(url: str, tid: str) -> dict:
    return httpx.get(f"{url}/v1/sessions/transfers/{tid}", timeout=5).json()


def transfers_on(url: str, ids: list[str]) -> list[str]:
    """Those of `ids` that the replica at `url` knows (live or recently ended)."""
    return [tid for tid in ids if (lambda st: st["incoming"] or st["outgoing"])(no_transfers(url, tid))]


def record_transfer_ids(monkeypatch: pytest.MonkeyPatch, seen: list[str]) -> None:
    """From now on, append to `seen` (emptied first) the id of every transfer migrate_live starts in
    this process (its result and its MigrationError carry the id too)."""
    import relayout.migrate.protocol.live as live

    real = live.new_transfer_id
    seen.clear()

    def rec() -> str:
        seen.append(real())
        return seen[-1]

    monkeypatch.setattr(live, "new_transfer_id", rec)
