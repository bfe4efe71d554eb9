"""The records of migrate.protocol.transfers' table: a source's rounds and outgoing transfers, a target's
incoming ones, and `EngineOps`, what the protocol asks of the replica's engine thread."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from relayout.engine.moves.snapshot import SessionSnapshot
from relayout.migrate.protocol.received import ReceivedChunks
from relayout.migrate.protocol.states import IncomingState, OutgoingState
from relayout.storage.format.manifest import KVGeometry, Manifest, ModelRef

if TYPE_CHECKING:
    from relayout.storage.checkpoint import CheckpointReader
    from relayout.storage.stream import Place


# ---- the records --------------------------------------------------------------------------------
@dataclass
class SourceRound:
    """A round taken on the source's engine thread: sessions it paused (final round) and their snapshots."""

    paused: list[str]
    snaps: list[SessionSnapshot]
    model: ModelRef
    layout: dict
    geometry: KVGeometry
    not_moved: dict[str, str] = field(default_factory=dict)  # session -> why it stays on the source

    @property
    def in_place(self) -> bool:
        """Every session's KV goes out as the pool's own rows (engine.moves.snapshot.DeferredKV.in_place)."""
        return all(s.deferred is not None and s.deferred.in_place for s in self.snaps)

    @property
    def kv_tokens(self) -> dict[str, int]:
        """Each session's KV tokens in this round (what the target holds of it once the round is in)."""
        return {s.session_id: s.num_kv_tokens for s in self.snaps}


@dataclass
class SentRound:
    """What one framed round sent: KV tokens per session (its manifest lists each from where the
    last round sent ended: a delta, SessionEntry.kv_from)."""

    epoch: int
    upto: dict[str, int]


@dataclass
class Outgoing:
    """Source: one outgoing transfer — what earlier rounds sent, and its lease."""

    transfer_id: str
    last: float  # clock time of the last sign of life (a round started or produced bytes)
    sent_upto: dict[str, int] = field(default_factory=dict)  # session -> KV tokens sent
    # chunks whose bytes the target holds (acknowledged by a resumed round), not sent again; the
    # target drops a round's bytes once imported, so chunks of completed rounds are not among them
    target_holds: set[str] = field(default_factory=set)
    rounds: int = 0
    paused: list[str] = field(default_factory=list)  # held by the final round, until release or resume
    final: bool = False  # the final round was cut (it may have held no session: all had finished)
    pushing: asyncio.Future | None = None  # the round being sent to the target (push mode), if any
    epoch: int = 0  # bumped by every export: a round framed under an older epoch is stale
    framed: SentRound | None = None  # push mode: the round framed, counted as sent once delivered
    not_moved: dict[str, str] = field(default_factory=dict)  # last round: asked for, not in it, and why
    in_place: bool = False  # last round: its chunks are the pool's own rows (SourceRound.in_place)
    header: dict[str, int] = field(default_factory=dict)  # last round: its sessions' KV tokens (the link's hello)
    timing: dict[str, float] = field(default_factory=dict)  # last round: its wait for the cut, its CPU since

    @property
    def state(self) -> OutgoingState:  # protocol_states: active -> paused (final round cut) -> ended
        return OutgoingState.PAUSED if self.final else OutgoingState.ACTIVE

    def mark_sent(self, r: SentRound | None) -> None:
        if r is self.framed:
            self.framed = None
        if r is not None and r.epoch == self.epoch:  # not overtaken by a retry (whose cut covers this one's)
            self.target_holds = set()
            self.sent_upto.update(r.upto)


@dataclass
class Incoming:
    """Target: one incoming transfer — staged chunks, reserved blocks, placed sessions, its lease
    (the KV part is engine.moves.receive.IncomingKV)."""

    transfer_id: str
    last: float
    source: str | None = None  # whom to ask how the transfer ended, if its migrator disappears
    store: ReceivedChunks = field(default_factory=ReceivedChunks)
    blocks: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    upto: dict[str, int] = field(default_factory=dict)
    placed: list[str] = field(default_factory=list)
    staged: int = 0  # bytes received, all rounds together
    final: bool = False  # the final round placed the sessions: held until commit
    first_doubt: float | None = None
    closed: bool = False  # dropped: the engine thread reserves nothing more for it (reserve_ahead)
    receiving: int = 0  # its rounds being read now: its blocks are freed only once none writes into them

    @property
    def state(self) -> IncomingState:
        return IncomingState.PLACED if self.final else IncomingState.RECEIVING


class EngineOps(Protocol):
    """What the protocol does on the replica's engine thread: `EngineThreadOps` (relayout's engine) and
    `VllmOps` (stock vLLM) implement it, and a type checker holds them to it (tests/typed_seams.py)."""

    # a round's chunks are written into the pool as they arrive (`placer`), so the frame link sends
    # each chunk's entry ahead of it; False: every chunk is staged and imported whole
    places_on_arrival: bool

    def placer(self, t: Incoming, header: dict[str, int], loop: asyncio.AbstractEventLoop) -> Place | None:
        """Where a round's chunks go as they arrive (storage.stream's `place`), or None: staged. Called
        on the link's thread; `header` (session -> KV tokens) is the round's, `loop` the replica's."""
        ...

    async def take_round(self, sessions: list[str] | None, pause: bool, sent: dict[str, int],
                         max_tokens: int | None) -> SourceRound:
        """Snapshot the sessions (all live ones: None) from `sent` on; with `pause`, hold them first.
        KeyError for a session that is not here."""
        ...

    async def take_checkpoint(self, sessions: list[str] | None, stop: bool) -> SourceRound:
        """A checkpoint's cut; with `stop`, the sessions are held."""
        ...

    async def restore(self, reader: CheckpointReader, sessions: list[str] | None, exact: bool
                      ) -> tuple[list[str], dict | None]:
        """Import sessions from a checkpoint: (their ids, the KV conversion if any)."""
        ...

    async def load_outcomes(self, session_ids: list[str]) -> dict[str, str]:
        """Sessions just placed whose KV was recomputed rather than imported, with why."""
        ...

    def import_limits(self, engine: Any) -> tuple[int, int]:
        """Bytes one incoming transfer may stage, and its largest frame (`engine`: the replica's)."""
        ...

    async def resume(self, session_ids: list[str]) -> None: ...

    async def release(self, session_ids: list[str], migrated_to: str | None) -> None: ...

    async def receive(self, t: Incoming, manifest: Manifest, final: bool) -> dict: ...

    async def commit(self, t: Incoming) -> list[str]: ...

    async def abort(self, t: Incoming) -> None: ...
