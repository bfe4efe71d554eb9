"""The protocol's engine operations on a vLLM replica (migrate.protocol.transfers.EngineOps, beside
migrate.protocol.engine_ops.EngineThreadOps for the builtin engine): the same cuts, rounds, commits and
restores, with the KV read out of and loaded into vLLM by relayout's connector
(engine.vllm.engine, engine.vllm.connector). The protocol does not know which engine it drives.

A cut freezes each session's state on the engine thread (at a step boundary, as the builtin's),
then reads its KV out of vLLM for tokens up to all but its last (the one vLLM feeds next). An
arriving session's KV is written to load files round by round as it arrives (pre-copy rounds
while the source still decodes), and its vLLM request starts at the commit, loading them.

A seeded sampled session is not moved: vLLM seeds one generator per request, so a resubmitted
request would restart its random stream and change its tokens. It keeps running on the source,
and the cut says why (`SourceRound.not_moved`)."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid

from relayout.engine.moves.placer import check_entry, check_model
from relayout.engine.moves.snapshot import RestoreError, SessionSnapshot, geometry, model_ref
from relayout.engine.runtime.async_engine import AsyncEngine
from relayout.engine.runtime.session import SessionState
from relayout.engine.vllm.engine import VllmEngine
from relayout.engine.vllm.exchange import ExchangeError, damage_staged, write_kv
from relayout.migrate.protocol.transfers import Incoming, SourceRound
from relayout.storage.checkpoint import CheckpointReader
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.manifest import Manifest, SessionEntry
from relayout.storage.settings import settings

log = logging.getLogger("relayout.vllm_ops")
LOAD_SETTLE_S = 30.0  # a restore waits this long for its sessions' loads to be taken (or recomputed)
SEEDED_NOT_MOVED = ("a seeded sampled session continues exactly only where its vLLM request runs (vLLM seeds a "
                    "generator per request): not moved, it keeps running here")


def not_movable(st: SessionState) -> str | None:
    return SEEDED_NOT_MOVED if not st.sampling.greedy and st.sampling.seed is not None else None


class VllmOps:
    """The protocol's engine operations on a vLLM replica (migrate.protocol.transfers.EngineOps)."""

    places_on_arrival = False  # every chunk is staged as a load file: vLLM's workers read it

    def __init__(self, aengine: AsyncEngine):
        self.aengine, self.call = aengine, aengine.call
        self.engine: VllmEngine = aengine.engine  # type: ignore[assignment]
        self.cut_engine_s = 0.0
        self.note_migrated = aengine.note_migrated
        self._files: dict[tuple[str, str], list[dict]] = {}  # (transfer, session) -> its staged files so far

    def placer(self, t: Incoming, header: dict[str, int], loop: asyncio.AbstractEventLoop) -> None:
        """None: a round's chunks are staged whole (vLLM loads them in its workers, not this process)."""
        return None

    # ---- source --------------------------------------------------------------------------------
    async def take_round(self, sessions: list[str] | None, pause: bool, sent: dict[str, int],
                  max_tokens: int | None) -> SourceRound:
        def freeze(e: VllmEngine) -> tuple[dict[str, SessionState], dict[str, str]]:
            if sessions is None:
                live = [sid for sid, s in e.sessions.items() if not s.is_finished]
            else:
                for sid in sessions:
                    if sid not in e.sessions:
                        raise KeyError(f"session {sid} is not on this replica")
                live = [sid for sid in sessions if not e.sessions[sid].is_finished]
            why = {sid: r for sid in live if (r := not_movable(e.sessions[sid])) is not None}
            moving = [sid for sid in live if sid not in why]
            if pause:
                e.pause(moving)
            return {sid: copy.deepcopy(e.sessions[sid]) for sid in moving}, why

        t0 = time.perf_counter()
        states, why = await self.aengine.call(freeze)
        self.cut_engine_s += time.perf_counter() - t0
        snaps, gone = [], []
        for sid, st in states.items():
            lo = sent.get(sid, 0)
            hi = st.num_tokens - 1
            if max_tokens is not None:
                hi = min(hi, lo + max_tokens)
            kv: list = []
            if hi > lo:
                try:
                    kv = await asyncio.to_thread(self.engine.export_tensors, sid, lo, hi)
                except ExchangeError as e:
                    # vLLM ended the request meanwhile (it finished there): nothing left to move; any other
                    # failure is named with its reason, and the session goes on here untouched
                    log.warning("session %s not moved: %s", sid, e)
                    gone.append(sid)
                    if not e.finished:
                        why[sid] = f"vLLM could not export its KV, so it keeps running here: {e}"
                    continue
            n = lo + (kv[0][2].shape[3] if kv else 0)
            snaps.append(SessionSnapshot(st, n, kv=kv))
        paused = [sid for sid in states if sid not in gone] if pause else []
        if pause and gone:
            await self.resume(gone)  # each ends here with what vLLM already produced
        return SourceRound(paused, snaps, model_ref(self.engine), self.engine.layout.to_dict(),  # type: ignore[arg-type]
                   geometry(self.engine), not_moved=why)  # type: ignore[arg-type]

    async def take_checkpoint(self, sessions: list[str] | None, stop: bool) -> SourceRound:
        return await self.take_round(sessions, stop, {}, None)

    async def resume(self, session_ids: list[str]) -> None:
        await self.aengine.call(lambda e: e.resume(session_ids))

    async def release(self, session_ids: list[str], migrated_to: str | None) -> None:
        if migrated_to:
            self.note_migrated(session_ids, migrated_to)
        await self.aengine.call(lambda e: e.release(session_ids))

    # ---- target --------------------------------------------------------------------------------
    def check(self, manifest: Manifest) -> None:
        e = self.engine
        check_model(e, manifest)  # type: ignore[arg-type]
        g, kv = geometry(e), manifest.kv  # type: ignore[arg-type]
        if (kv.dtype, kv.scale) != (g.dtype, g.scale):
            raise RestoreError(f"checkpoint {manifest.checkpoint_id} holds {kv.dtype} KV"
                               f"{' (fp8 with scales)' if kv.scale else ''}; this vLLM replica's KV is {g.dtype}: "
                               "a vLLM replica imports KV of its own dtype only")

    def _states(self, manifest: Manifest, session_ids: list[str] | None = None) -> list[tuple[SessionState, int]]:
        e = self.engine
        entries = [manifest.session(sid) for sid in session_ids] if session_ids else manifest.sessions
        out = []
        for en in entries:
            st = check_entry(e, en)  # type: ignore[arg-type]
            if (why := not_movable(st)) is not None:
                raise RestoreError(f"session {st.session_id}: {why.split(':')[0]}; it cannot continue in a vLLM replica")
            out.append((st, en.num_kv_tokens))
        return out

    def stage(self, key: tuple[str, str], reader: CheckpointReader, sid: str, lo: int, hi: int) -> None:
        name = f"s-{uuid.uuid4().hex}.safetensors"  # never a caller's id in a file name
        digest = write_kv(self.engine.exchange.dir / name, reader.read_tokens(sid, lo, hi), 0,
                          self.engine.cfg.num_kv_heads, lo, hi)
        entry = {"name": name, "tok_lo": lo, "tok_hi": hi, "hash": digest}
        if (fault := settings().vllm_stage_fault) is not None:
            entry = damage_staged(self.engine.exchange.dir, entry, fault)
        self._files.setdefault(key, []).append(entry)

    async def receive(self, t: Incoming, manifest: Manifest, final: bool) -> dict:
        self.check(manifest)
        states = self._states(manifest)
        reader = CheckpointReader(t.store, manifest=manifest)
        imported = 0
        for st, _ in states:
            imported += await self.stage_new(t.transfer_id, reader, t.upto, manifest.session(st.session_id))
        if final:
            def place(e: VllmEngine) -> None:
                for st, n_kv in states:
                    st.num_computed = n_kv
                    e.adopt(st, self.take_load(t.transfer_id, st.session_id, n_kv))
                    t.placed.append(st.session_id)

            await self.aengine.call(place)
        return {"sessions": sorted(st.session_id for st, _ in states), "imported_tokens": imported}

    async def stage_new(self, tid: str, reader: CheckpointReader, upto: dict[str, int], en: SessionEntry) -> int:
        """Stage a round's KV of one session beyond the `upto` tokens held (a file under `tid`); the tokens staged."""
        sid, have, n_kv = en.session_id, upto.get(en.session_id, 0), en.num_kv_tokens
        if en.kv_from > have:
            raise CorruptCheckpoint(f"session {sid}: this round's KV starts at token {en.kv_from}, "
                                    f"this replica holds {have} of it")
        upto[sid] = max(have, n_kv)
        if n_kv <= have:
            return 0
        await asyncio.to_thread(self.stage, (tid, sid), reader, sid, have, n_kv)
        return n_kv - have

    def take_load(self, tid: str, sid: str, n_kv: int) -> dict | None:
        """The load of session `sid`'s files staged under `tid` (its request takes them; they are not
        this table's any more)."""
        files = self._files.pop((tid, sid), [])
        return {"tokens": n_kv, "files": files} if files and n_kv else None

    def drop_files(self, tid: str, sid: str | None = None) -> None:
        """Remove the files staged under `tid` (of session `sid` only, when given)."""
        for key in [k for k in self._files if k[0] == tid and (sid is None or k[1] == sid)]:
            for f in self._files.pop(key):
                (self.engine.exchange.dir / f["name"]).unlink(missing_ok=True)

    async def commit(self, t: Incoming) -> list[str]:
        self.drop_files(t.transfer_id)
        await self.resume(t.placed)
        return list(t.placed)

    async def abort(self, t: Incoming) -> None:
        placed, t.placed = list(t.placed), []

        def drop(e: VllmEngine) -> None:
            for sid in placed:
                e.discard(sid)

        await self.aengine.call(drop)
        self.drop_files(t.transfer_id)

    async def restore(self, reader: CheckpointReader, sessions: list[str] | None, exact: bool
                      ) -> tuple[list[str], dict | None]:
        """All or nothing: every check and every load file before any session is placed."""
        m = reader.manifest
        self.check(m)
        states = self._states(m, sessions)
        gap = m.coverage_error()
        if gap is not None:
            raise CorruptCheckpoint(f"checkpoint {m.checkpoint_id} is incomplete: {gap}")
        await asyncio.to_thread(reader.verify)
        tid = f"restore-{m.checkpoint_id}"
        try:
            for st, n_kv in states:
                if n_kv:
                    await asyncio.to_thread(self.stage, (tid, st.session_id), reader, st.session_id, 0, n_kv)
        except BaseException:
            self.drop_files(tid)
            raise

        def place(e: VllmEngine) -> list[str]:
            for st, n_kv in states:
                st.num_computed = n_kv
                e.adopt(st, self.take_load(tid, st.session_id, n_kv))
            ids = [st.session_id for st, _ in states]
            e.resume(ids)
            return ids

        return await self.aengine.call(place), None

    async def load_outcomes(self, session_ids: list[str], timeout_s: float = LOAD_SETTLE_S) -> dict[str, str]:
        """Sessions just placed whose KV load failed in vLLM's workers (vLLM recomputed it), with why:
        waits until each placed request has taken its load (its first token) or ended, or `timeout_s`."""
        e = self.engine
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not any(e.load_pending(sid) for sid in session_ids):
                break
            await asyncio.sleep(0.01)
        return {sid: e.recomputed[sid] for sid in session_ids if sid in e.recomputed}

    def import_limits(self, engine: VllmEngine) -> tuple[int, int]:
        """Bytes one incoming transfer may stage, and its largest frame: what this replica's context could hold."""
        from relayout.engine.moves.snapshot import CHUNK_TOKENS
        from relayout.storage.format.manifest import MAX_MANIFEST_BYTES

        c, item = engine.cfg, engine.dtype.itemsize
        per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * item
        chunk = 2 * c.num_kv_heads * CHUNK_TOKENS * c.head_dim * item + (64 << 10)
        limit = 64 * engine.max_model_len * per_token + MAX_MANIFEST_BYTES
        return limit, min(max(MAX_MANIFEST_BYTES, 2 * chunk) + (1 << 20), limit)
