"""Protection, the source's half (docs/protocol.md, "Protection"): a `Replicator` sends every live
session's new KV and state to a standby replica continuously, as rounds of one long-lived
protection — the same frames as a live migration's pre-copy rounds (the chunks the standby lacks, then a
manifest: a delta one, listing each session's KV from what the standby holds on). A round goes when a session has `every_tokens` new tokens or
`every_ms` passed since the last one, whichever first.

Ownership is a lease: each round the standby accepts renews it for `lease_s` from the moment the
round was cut. When the lease lapses (the standby unreachable: dead, or a partition), this
replica stops serving the sessions the standby holds (pauses them: "fenced") before the standby
may promote them (it waits longer: migrate.protection.standby). A later round that gets through resumes
them; a standby that answers "promoted" owns them: they are released here (migrated to it)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlencode

import httpx
from relayout.engine.moves.snapshot import write_snapshot
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.tracing import span
from relayout.engine.web import bearer_headers, error_message, tls_context
from relayout.migrate.protection.round_post import RoundPoster
from relayout.migrate.protocol.engine_ops import EngineThreadOps
from relayout.migrate.protocol.states import LIVE_PROTECTION, ProtectionState
from relayout.migrate.protocol.transfers import SourceRound
from relayout.migrate.transport.frame_sink import FrameSink
from relayout.storage.checkpoint import CheckpointWriter
from relayout.storage.format.manifest import Manifest

PROMOTED = "protection_promoted"  # the error type a standby answers once it owns the sessions
DROPPED = "protection_dropped"  # the error type for a protection the standby has dropped
WATCH_S = 0.05  # how often the lease and the sessions' progress are looked at
LEASE_S = 0.6  # the default lease (migrate.protection.standby may promote LEASE_S + PROMOTE_MARGIN_S after the last round)


@dataclass
class ProtectConfig:
    standby: str  # the standby replica's URL, as this replica reaches it
    source_url: str  # this replica's URL, as the standby reaches it (to ask whether it is alive)
    every_tokens: int = 16
    every_ms: int = 200
    lease_s: float = LEASE_S
    codec: str = "none"


# the state's lists that only grow while a session lives: a round sends only their new items
GROWING_LISTS = ("prompt_token_ids", "output_token_ids", "logprobs")


@dataclass
class SyncedSession:
    kv_tokens: int  # KV positions the standby holds
    lists: dict[str, int]  # GROWING_LISTS' lengths in the state it holds

    @classmethod
    def of(cls, kv_tokens: int, state: dict) -> SyncedSession:
        return cls(kv_tokens, {k: len(state[k]) for k in GROWING_LISTS if isinstance(state.get(k), list)})

    @property
    def tokens(self) -> int:
        """Prompt + generated tokens at the last sync (their ids travelled with it)."""
        return self.lists.get("prompt_token_ids", 0) + self.lists.get("output_token_ids", 0)


@dataclass
class Replicator:
    """One protection of this replica's sessions to one standby. Runs as a task on the server's loop."""

    pid: str
    cfg: ProtectConfig
    ops: EngineThreadOps
    progress: Callable[[], dict[str, int]]  # live session -> tokens now (read without the engine thread)
    # the engine's longest step lately (AsyncEngine.recent_step_s): a fence waits for a step boundary
    step_s: Callable[[], float] = lambda: 0.0
    token: str | None = None
    clock: Callable[[], float] = time.monotonic
    state: ProtectionState = ProtectionState.ACTIVE  # migrate.protocol.states: active | fenced | lost | stopped
    synced: dict[str, SyncedSession] = field(default_factory=dict)
    rounds: int = 0
    round_bytes: int = 0
    lease_until: float = 0.0
    fenced: list[str] = field(default_factory=list)
    fences: int = 0  # times the lease lapsed here (each paused the sessions until a round got through)
    last_error: str | None = None
    last_round_at: float = 0.0
    # live sessions the rounds do not carry, with why (a seeded sampled one on vLLM, on either side)
    not_protected: dict[str, str] = field(default_factory=dict)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @staticmethod
    def new_id() -> str:
        return f"prot-{secrets.token_hex(6)}"

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.lease_until = self.clock() + self.cfg.lease_s  # nothing is fenced before the first round
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._rounds()), loop.create_task(self._watch_lease())]

    async def stop(self) -> dict:
        """End the protection: the standby frees its copies; sessions this replica fenced run here
        again unless the standby already owns them."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.state == ProtectionState.LOST:
            return {"protection": self.pid, "state": ProtectionState.LOST}
        self.state = ProtectionState.STOPPED
        standby_state = None
        try:
            async with httpx.AsyncClient(verify=tls_context(), timeout=5.0) as c:
                r = await c.delete(f"{self.cfg.standby}/v1/standby/{self.pid}", headers=bearer_headers(self.token))
            standby_state = r.json().get("state") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            pass
        if standby_state == "promoted":
            await self._lose()
        elif self.fenced and standby_state is not None:  # the standby confirmed it serves none of them
            await self.ops.resume(self.fenced)
            self.fenced = []
        return {"protection": self.pid, "state": self.state, "standby": standby_state,
                "still_fenced": list(self.fenced)}

    def view(self) -> dict:
        now = self.progress()
        sessions = [{"id": sid, "tokens": n, "synced_tokens": self.synced[sid].tokens if sid in self.synced else 0,
                     "lag_tokens": n - (self.synced[sid].tokens if sid in self.synced else 0)}
                    for sid, n in sorted(now.items()) if sid not in self.not_protected]
        unprotected = {sid: why for sid, why in self.not_protected.items() if sid in now}
        return {"protection": self.pid, "standby": self.cfg.standby, "state": self.state, "rounds": self.rounds,
                "bytes": self.round_bytes, "every_tokens": self.cfg.every_tokens, "every_ms": self.cfg.every_ms,
                "lease_s": self.cfg.lease_s, "lease_left_s": round(max(0.0, self.lease_until - self.clock()), 3),
                # what the rounds cost the decode: the engine thread's time in their cuts, per round
                "engine_ms_per_round": round(1000 * self.ops.cut_engine_s / max(1, self.rounds), 3),
                "fenced": list(self.fenced), "fences": self.fences, "last_error": self.last_error, "sessions": sessions,
                "not_protected": unprotected,
                "max_lag_tokens": max((s["lag_tokens"] for s in sessions), default=0)}

    # ---- the rounds ---------------------------------------------------------------------------------
    def _due(self) -> bool:
        if self.clock() - self.last_round_at >= self.cfg.every_ms / 1000:
            return True
        now = self.progress()
        for sid, n in now.items():
            if sid in self.not_protected:
                continue
            if n - (self.synced[sid].tokens if sid in self.synced else 0) >= self.cfg.every_tokens:
                return True
        return len(now) < len(self.synced)  # one finished: free its copy soon

    def _poster(self) -> RoundPoster:
        """The rounds' POSTs, over one kept connection (migrate.protection.round_post: httpx's client cost ~0.37 ms
        of the source's core a round, against ~0.06)."""
        query = urlencode({"source": self.cfg.source_url, "lease_s": str(self.cfg.lease_s)})
        return RoundPoster(httpx.URL(f"{self.cfg.standby}/v1/standby/{self.pid}/rounds?{query}"),
                           httpx.Headers(bearer_headers(self.token)), connect_s=max(0.2, self.cfg.lease_s / 2),
                           read_s=60.0)

    async def _rounds(self) -> None:
        poster = self._poster()
        try:
            while self.state in LIVE_PROTECTION:
                while not self._due():
                    await asyncio.sleep(WATCH_S / 2)
                self.last_round_at = self.clock()
                try:
                    await self._round(poster)
                    self.last_error = None
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - keep trying; the lease decides when to fence
                    self.last_error = f"{type(e).__name__}: {e}"
                    await asyncio.sleep(min(0.2, self.cfg.every_ms / 1000))
        finally:
            poster.close()

    async def _round(self, poster: RoundPoster) -> None:
        with span("protection-round", protection=self.pid, round=self.rounds + 1) as sp:
            t0 = self.clock()  # the lease counts from before the cut: the standby stamps it later
            sent = {sid: s.kv_tokens for sid, s in self.synced.items()}
            cut = await self.ops.take_round(None, False, sent, None)
            for snap in cut.snaps:
                # a session preempted here and still recomputing: its KV on the standby stays valid
                snap.num_kv_tokens = max(snap.num_kv_tokens, sent.get(snap.session_id, 0))
            rnd = self.rounds + 1
            held = {sid: s.lists for sid, s in self.synced.items()}
            # on the loop, not a worker thread: ~1.2 ms of Python that holds the interpreter either
            # way, without the hand-offs (bench replication: 0.894-0.911 of unprotected decode, five
            # runs, against 0.860-0.895 through asyncio.to_thread, alternating)
            manifest, frames = self._frames(cut, sent, held, rnd)
            body = b"".join(frames)
            r = await poster.post(body)
            if r.status_code == 409 and _error_type(r) in (PROMOTED, DROPPED):
                await self._lose()
                return
            if r.status_code != 200:
                if 400 <= r.status_code < 500:  # the standby lost what it held (restarted): send it all again
                    self.synced = {}
                raise RuntimeError(f"standby refused round {rnd}: HTTP {r.status_code}: {error_message(r)}")
            self.lease_until = t0 + self.cfg.lease_s
            self.rounds, self.round_bytes = rnd, self.round_bytes + len(body)
            sp.set_attribute("relayout.bytes", len(body))
            whole = {snap.session_id: snap.state_dict for snap in cut.snaps}  # (the manifest's lists may be deltas)
            try:
                not_held = dict(r.json().get("not_held") or {})
            except (ValueError, AttributeError, TypeError):
                not_held = {}
            self.not_protected = {**cut.not_moved, **{sid: f"the standby does not hold it: {why}"
                                                       for sid, why in not_held.items()}}
            self.synced = {e.session_id: SyncedSession.of(e.num_kv_tokens, whole[e.session_id])
                           for e in manifest.sessions if e.session_id not in not_held}
            if self.state == ProtectionState.FENCED:
                fenced, self.fenced, self.state = self.fenced, [], ProtectionState.ACTIVE
                await self.ops.resume(fenced)

    def _frames(self, cut: SourceRound, sent: dict[str, int], held: dict[str, dict[str, int]],
                rnd: int) -> tuple[Manifest, list[bytes]]:
        """One round's frames: the new chunks, then a delta manifest: every live
        session's state, its growing lists from what the standby holds on (SessionEntry.state_from),
        and its KV from what the standby holds on (SessionEntry.kv_from). A
        cumulative manifest (what a migration's rounds sent before 0.5.0) would list every earlier round's
        chunks again: its size, and the work on both ends, would grow with every round of a
        protection that lasts as long as its sessions. A session missing from the round (finished)
        is dropped by the standby; a new chunk is sent even when an earlier one had the same bytes
        (the standby frees each chunk once imported)."""
        sink = FrameSink(set())
        w = CheckpointWriter(sink, f"{self.pid}-r{rnd}", codec=self.cfg.codec, kv_from=sent, state_from=held)
        write_snapshot(cut.snaps, w, sent)
        m = w.commit(cut.model, cut.layout, cut.geometry, {"protection": self.pid, "round": rnd})
        return m, sink.take()

    # ---- the lease ----------------------------------------------------------------------------------
    async def _watch_lease(self) -> None:
        while self.state in LIVE_PROTECTION:
            # fenced ahead: the pause waits for the step under way (and this loop for its next look),
            # so the sessions are paused by the time the lease ends, not one step and a look after it
            if self.state == ProtectionState.ACTIVE and self.clock() > self.lease_until - self.fence_ahead_s():
                await self._fence()
            await asyncio.sleep(WATCH_S)

    def fence_ahead_s(self) -> float:
        """How long before the lease's end the sessions are fenced: one look of the watch, the step
        under way (twice the longest lately: a step may run long under load), at most half the lease."""
        return min(self.cfg.lease_s / 2, WATCH_S + 2 * self.step_s())

    async def _fence(self) -> None:
        """The lease lapsed: stop serving what the standby holds before it may promote it."""
        with span("protection-fence", protection=self.pid):
            ids = list(self.synced)

            def pause(e: LLMEngine) -> list[str]:
                live = [sid for sid in ids if sid in e.sessions and not e.sessions[sid].is_finished]
                e.pause(live)
                return live

            # paused first, then reported: whoever sees "fenced" sees them stopped (a round that renews
            # the lease meanwhile leaves them paused until the next one resumes them)
            self.fenced = await self.ops.call(pause)
            self.state, self.fences = ProtectionState.FENCED, self.fences + 1

    async def _lose(self) -> None:
        """The standby promoted: the sessions it holds are its own now; free them here."""
        with span("protection-lost", protection=self.pid):
            self.state = ProtectionState.LOST
            ids = list(dict.fromkeys(self.fenced + list(self.synced)))
            self.fenced = []
            await self.ops.release(ids, self.cfg.standby)


def _error_type(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return None


def engine_progress(engine: LLMEngine) -> Callable[[], dict[str, int]]:
    """Live session -> tokens, read from the event loop while the engine thread runs: a racy read of
    ints, good enough to decide when a round is due (the round itself is cut on the engine thread)."""

    def read() -> dict[str, int]:
        for _ in range(5):
            try:
                return {sid: s.num_tokens for sid, s in list(engine.sessions.items()) if not s.is_finished}
            except RuntimeError:  # the dict changed size under us: read again
                continue
        return {}

    return read
