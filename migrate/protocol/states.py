"""The live-migration protocol's vocabulary, in one place (docs/protocol.md): what the migrator's
phases, a replica's outgoing and incoming transfers and a protection can be, which moves between
them are legal, and the refusals a replica answers with. The values are the wire's (`GET
/v1/sessions/transfers/{id}`, traces, operation phases): a member equals the string a peer sends.

    outgoing (source)   active -> paused (final round cut) -> released (the commit)
                        active | paused -> aborted | expired (the sessions run on the source again)
    incoming (target)   receiving -> placed (final round imported) -> committed
                        receiving | placed -> aborted | expired (reservations and placed sessions freed)
    migrator phases     pre-copy:K ... -> stop-and-copy -> prepared -> committed -> done
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from enum import Enum


class _Wire(str, Enum):
    """A state that is its wire string: equal to it, formatted and JSON-encoded as it."""

    def __str__(self) -> str:
        return self.value


class OutgoingState(_Wire):
    ACTIVE = "active"
    PAUSED = "paused"
    RELEASED = "released"
    ABORTED = "aborted"
    EXPIRED = "expired"


class IncomingState(_Wire):
    RECEIVING = "receiving"
    PLACED = "placed"
    COMMITTED = "committed"
    ABORTED = "aborted"
    EXPIRED = "expired"


class Phase(_Wire):
    """The migrator's phases (migrate.protocol.live), each a span of the migration's trace."""

    PRE_COPY = "pre-copy"  # one per round, as "pre-copy:K"
    STOP_AND_COPY = "stop-and-copy"
    PREPARED = "prepared"  # the target holds the sessions, paused; the source still owns them
    COMMITTED = "committed"  # the source released them: they belong to the target
    DONE = "done"


class ProtectionState(_Wire):
    """A protection's state on its source (migrate.protection.replication), as its standby and agent ask it."""

    ACTIVE = "active"
    FENCED = "fenced"  # the lease could not be renewed: the source holds its sessions' tokens back
    LOST = "lost"  # the standby promoted: the sessions are its now
    STOPPED = "stopped"


# per state class: the members are equal to their wire strings, so "active" of a transfer and of a
# protection would be one dict key
TRANSITIONS: dict[type[_Wire], dict[_Wire, frozenset[_Wire]]] = {
    OutgoingState: {OutgoingState.ACTIVE: frozenset({OutgoingState.PAUSED, OutgoingState.ABORTED, OutgoingState.EXPIRED}),
                    OutgoingState.PAUSED: frozenset({OutgoingState.RELEASED, OutgoingState.ABORTED,
                                                     OutgoingState.EXPIRED})},
    IncomingState: {IncomingState.RECEIVING: frozenset({IncomingState.PLACED, IncomingState.ABORTED,
                                                        IncomingState.EXPIRED}),
                    IncomingState.PLACED: frozenset({IncomingState.COMMITTED, IncomingState.ABORTED,
                                                     IncomingState.EXPIRED})},
    # the migrator's own run (migrate.protocol.live.STAGES: one stage function per phase, each naming the next)
    Phase: {Phase.PRE_COPY: frozenset({Phase.STOP_AND_COPY}), Phase.STOP_AND_COPY: frozenset({Phase.PREPARED}),
            Phase.PREPARED: frozenset({Phase.COMMITTED}), Phase.COMMITTED: frozenset({Phase.DONE})},
    ProtectionState: {ProtectionState.ACTIVE: frozenset({ProtectionState.FENCED, ProtectionState.LOST,
                                                         ProtectionState.STOPPED}),
                      ProtectionState.FENCED: frozenset({ProtectionState.ACTIVE, ProtectionState.LOST,
                                                         ProtectionState.STOPPED})},
}
ENDED_OUTGOING = frozenset({OutgoingState.RELEASED, OutgoingState.ABORTED, OutgoingState.EXPIRED})
ENDED_INCOMING = frozenset({IncomingState.COMMITTED, IncomingState.ABORTED, IncomingState.EXPIRED})
LIVE_PROTECTION = frozenset({ProtectionState.ACTIVE, ProtectionState.FENCED})  # the source still owns the sessions


# (source replica URL, transfer or protection id) -> the source's state of it, as its wire string
# (an OutgoingState or a ProtectionState; None: the source does not know it); raises when the
# source cannot be asked. How a target in doubt asks the source (transfers.py and standby.py).
AskSource = Callable[[str, str], Awaitable[str | None]]

# A session asked for that a round does not carry because it ended on the source first: the only
# not-moved reason that needs no action (any other means the source's engine keeps the session).
FINISHED_ON_SOURCE = "finished on the source before this round"


class IllegalTransition(RuntimeError):
    """A move the table above does not allow: a bug on this side, never a peer's input."""


def check_transition(old: _Wire, new: _Wire) -> _Wire:
    if type(new) is not type(old) or new not in TRANSITIONS[type(old)].get(old, frozenset()):
        raise IllegalTransition(f"{type(old).__name__} {old} -> {new} is not a protocol move")
    return new


# ---- refusals (the routes map each to its HTTP status) ---------------------------------------------
class TransferError(Exception):
    """A request the protocol refuses; nothing changed."""


class TransferConflict(TransferError):
    """The transfer is in the wrong state for this (ended, final round already run, busy)."""


class UnknownTransfer(TransferError):
    """No such transfer here, now or in the recent past."""


class UnknownSession(TransferError):
    """A session named in the request is not on this replica."""


class TooManyTransfers(TransferError):
    """Too many (TransferTable.max_transfers) incoming transfers are already in flight."""


class ImportTooLarge(TransferError):
    """A round declares or sends more than this replica could ever hold."""
