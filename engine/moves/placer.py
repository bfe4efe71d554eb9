"""Every session that arrives at a replica enters through `SessionPlacer`: a checkpoint's restore,
a live transfer's rounds (engine/moves/receive.py), a standby's promotion (migrate/protection/standby.py).

One path — check, reserve, import, place — and one vocabulary for what goes wrong: `ModelMismatch`
(another model), `CorruptCheckpoint` (the data contradicts itself or the model), `RestoreError`
(well-formed, but this replica cannot take it: room, context length, dtype, a live duplicate).
The scheduler allocates KV blocks for sessions it admits; everything that arrives is allocated,
imported (engine/moves/kv_import.py, the one KV write path) and freed here. Engine thread only."""

from __future__ import annotations

from relayout.engine.kv_cache import blocks_needed
from relayout.engine.moves.kv_import import import_session
from relayout.engine.moves.snapshot import RestoreError, geometry
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SessionState, SessionStatus
from relayout.storage.checkpoint import CheckpointReader
from relayout.storage.errors import CorruptCheckpoint, ModelMismatch
from relayout.storage.format.manifest import Manifest, SessionEntry

Reserved = dict[str, tuple[int, list[int]]]  # session id -> (attention-DP group, its reserved blocks)


def check_model(engine: LLMEngine, manifest: Manifest) -> None:
    """The checkpoint's model and KV geometry are this replica's (either engine: the vLLM one has
    the same `fingerprint`, `model_ref` and geometry)."""
    if manifest.model.fingerprint != engine.fingerprint:
        raise ModelMismatch(f"checkpoint {manifest.checkpoint_id} is of model {manifest.model.name} "
                            f"(fingerprint {manifest.model.fingerprint[:12]}), this replica serves "
                            f"{engine.model_ref} (fingerprint {engine.fingerprint[:12]})")
    g, kv = geometry(engine), manifest.kv
    if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (g.num_layers, g.num_kv_heads, g.head_dim):
        raise CorruptCheckpoint(f"checkpoint KV geometry {kv} does not match the model's {g}")


def check_entry(engine: LLMEngine, e: SessionEntry) -> SessionState:
    """One session entry this replica may take (either engine), as its state; changes nothing."""
    st = SessionState.from_dict(e.state)
    if st.session_id != e.session_id:
        raise CorruptCheckpoint(f"session entry {e.session_id} holds state of {st.session_id}")
    old = engine.sessions.get(st.session_id)
    if old is not None and not old.is_finished:
        raise RestoreError(f"session {st.session_id} is already live on this replica")
    if any(t >= engine.cfg.vocab_size for t in st.all_token_ids):
        raise CorruptCheckpoint(f"session {st.session_id} holds token ids outside the vocabulary")
    if st.num_tokens + st.sampling.max_tokens - len(st.output_token_ids) > engine.max_model_len:
        raise RestoreError(f"session {st.session_id} needs more context than this replica's {engine.max_model_len}")
    if e.num_kv_tokens > st.num_tokens:
        raise CorruptCheckpoint(f"session {e.session_id} declares {e.num_kv_tokens} KV tokens but holds "
                                f"only {st.num_tokens} tokens")
    return st


def kv_conversion(engine: LLMEngine, manifest: Manifest) -> dict[str, str] | None:
    """{"from": checkpoint KV dtype, "to": this replica's} when they differ (a restore casts, quantises
    into fp8 or dequantises out of it), else None."""
    g, kv = geometry(engine), manifest.kv
    if (kv.dtype, kv.scale) == (g.dtype, g.scale):
        return None
    return {"from": kv.dtype, "to": g.dtype}


def check_compatible(engine: LLMEngine, manifest: Manifest, exact: bool = False) -> None:
    """The checkpoint's model and KV geometry are this replica's; its KV dtype may differ (converted
    on import, see kv_conversion) unless `exact`."""
    check_model(engine, manifest)
    g, kv = geometry(engine), manifest.kv
    conv = kv_conversion(engine, manifest)
    if conv is not None and exact:
        raise RestoreError(f"checkpoint {manifest.checkpoint_id} holds {conv['from']} KV, this replica's KV is "
                           f"{conv['to']}: an exact restore does not convert (restore without exact to convert)")
    own = engine.executor.own_pool()
    if (kv.scale or g.scale) and conv is not None and own is None:
        raise RestoreError(f"converting {conv['from']} KV to {conv['to']} needs a replica whose KV pool is local "
                           "host memory (one rank, CPU)")
    if kv.scale and own is None:
        raise RestoreError("fp8 KV moves only into a replica whose KV pool is local host memory (one rank, CPU)")


class SessionPlacer:
    """Reserve -> import -> place for the sessions arriving at one replica (see the module's doc)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    # ---- room ------------------------------------------------------------------------------------
    def _group_for(self, sid: str, need: int, free: list[int], load: list[int]) -> int:
        """The least loaded attention-DP group with `need` free blocks (lowest index on a tie)."""
        g = next((g for g in sorted(range(len(free)), key=lambda g: (load[g], g)) if free[g] >= need), None)
        if g is None:
            raise RestoreError(f"not enough free KV blocks for session {sid}: needs {need}, "
                               f"largest free pool has {max(free)}")
        return g

    def _free_and_load(self) -> tuple[list[int], list[int]]:
        e = self.engine
        return [a.num_free for a in e.allocators], [e.scheduler.group_load(g) for g in range(len(e.allocators))]

    def plan(self, manifest: Manifest, session_ids: list[str] | None = None
             ) -> list[tuple[SessionState, int, int]]:
        """(state, KV tokens, group) for each session of a checkpoint, checked, with room for all of
        them together; RestoreError (or CorruptCheckpoint) otherwise. Changes nothing."""
        entries = [manifest.session(sid) for sid in session_ids] if session_ids else manifest.sessions
        free, load = self._free_and_load()
        out = []
        for e in entries:
            st = check_entry(self.engine, e)
            need = blocks_needed(st.num_tokens + 1) if e.num_kv_tokens else 0
            g = self._group_for(st.session_id, need, free, load)
            free[g] -= need
            load[g] += 1
            out.append((st, e.num_kv_tokens, g))
        return out

    def reserve(self, reserved: Reserved, sid: str, need: int, headroom: int = 0) -> tuple[int, list[int]]:
        """Blocks for `need` (+ `headroom`, for a new reservation) KV blocks of session `sid`, kept in
        `reserved`: a new reservation in the least loaded group, or the one it has, grown."""
        e = self.engine
        if sid not in reserved:
            free, load = self._free_and_load()
            g = self._group_for(sid, need + headroom, free, load)
            reserved[sid] = (g, e.allocators[g].allocate(need + headroom))
        g, blocks = reserved[sid]
        if need > len(blocks):
            if not e.allocators[g].can_allocate(need - len(blocks)):
                raise RestoreError(f"not enough free KV blocks for session {sid} to grow to {need}")
            blocks += e.allocators[g].allocate(need - len(blocks))
        return reserved[sid]

    def release(self, reserved: Reserved, session_ids: list[str] | None = None) -> None:
        """Give back the reservations of `session_ids` (default: all of them)."""
        for sid in list(reserved) if session_ids is None else session_ids:
            if sid in reserved:
                g, blocks = reserved.pop(sid)
                self.engine.allocators[g].free(blocks)

    # ---- place -----------------------------------------------------------------------------------
    def claim(self, reserved: Reserved, sid: str, with_kv: bool = True) -> tuple[int, list[int] | None]:
        """Session `sid`'s reservation, out of `reserved`, to place it; `with_kv` False (it brought no
        KV: it will be prefilled) gives the blocks back instead."""
        g, blocks = reserved[sid]
        if not with_kv:
            self.release(reserved, [sid])
            return g, None
        return reserved.pop(sid)

    def place(self, st: SessionState, n_kv: int, group: int, blocks: list[int] | None,
              status: SessionStatus = SessionStatus.RUNNING) -> None:
        """The session is this replica's now, in `status`, its first `n_kv` tokens' KV in `blocks`.
        Without blocks (it brought no KV) it queues to be prefilled here from scratch."""
        st.num_computed = n_kv
        st.status = status if blocks is not None else SessionStatus.WAITING
        self.engine.adopt(st, group, blocks)

    def restore(self, reader: CheckpointReader, session_ids: list[str] | None = None, verify: bool = True,
                exact: bool = False) -> list[str]:
        """A checkpoint's sessions into this replica, all or nothing: the cheap checks first, then every
        session's KV into freshly reserved blocks, each chunk's hash checked once, as it is copied
        (before any session is placed); only when all of them imported are the sessions placed. A
        refused restore frees those blocks and leaves the replica as it was. `verify` also checks the
        whole manifest's coverage up front. KV of another dtype is converted (kv_conversion) unless
        `exact`, which refuses it."""
        m = reader.manifest
        check_compatible(self.engine, m, exact)
        plan = self.plan(m, session_ids)
        if verify:
            gap = m.coverage_error()
            if gap is not None:
                raise CorruptCheckpoint(f"checkpoint {m.checkpoint_id} is incomplete: {gap}")
        reserved: Reserved = {}
        try:
            for st, n_kv, g in plan:
                if n_kv:
                    sid = st.session_id
                    need = blocks_needed(st.num_tokens + 1)
                    reserved[sid] = (g, self.engine.allocators[g].allocate(need))  # room was planned above
                    import_session(self.engine, reader, sid, g, reserved[sid][1], n_kv,
                                   self.engine.executor.host_pools(g, every_copy=True))
        except BaseException:
            self.release(reserved)
            raise
        for st, n_kv, g in plan:
            self.place(st, n_kv, g, reserved.pop(st.session_id, (g, None))[1])
        return [st.session_id for st, _, _ in plan]


def restore(engine: LLMEngine, reader: CheckpointReader, session_ids: list[str] | None = None,
            verify: bool = True, exact: bool = False) -> list[str]:
    """Import a checkpoint's sessions (engine thread, between steps): SessionPlacer.restore."""
    return SessionPlacer(engine).restore(reader, session_ids, verify, exact)
