"""Moving everything off a replica: `relocate` sweeps a source until nothing live is left on it.

One loop for every caller that empties a replica: the controller (`migrate_live` to the replica it
launched), the fleet controller (an agent's migrate operation per move) and a node drain (one per
replica). Each pass lists the source again, so sessions that arrived meanwhile move too and those
that finished drop out; a failed move is tried again on the next pass, and after `alone_after`
failed moves of a whole group the sessions move one by one, so one bad session cannot hold back
the rest. The result names every session: moved, finished on the source, or not moved and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from relayout.migrate.protocol.live import MigrationError, MigrationResult

GONE = ("finished", "migrated")  # session states no longer served by a replica (anything else still is)
ListLive = Callable[[], list[str]]  # the sessions live on the source now
Move = Callable[[list[str]], MigrationResult]  # move these; raises one of `failures` when it fails


@dataclass
class Relocation:
    migrations: list[MigrationResult] = field(default_factory=list)  # the moves that succeeded, in order
    moved: list[str] = field(default_factory=list)  # run on the target now (a failed move's committed ones too)
    finished_here: list[str] = field(default_factory=list)  # ended on the source before their move
    # given up on, with why: the source's engine keeps it (a seeded vLLM request), or a move of it alone failed
    not_moved: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # every failed move's error, in order
    last_error: dict[str, str] = field(default_factory=dict)  # per session: the last failed move it was in
    left: list[str] = field(default_factory=list)  # still live on the source after the last pass
    source_error: str | None = None  # the source could not be listed: what is left there is unknown

    def _add_moved(self, sessions: list[str]) -> None:
        self.moved += [s for s in sessions if s not in self.moved]


def relocate(live_sessions: ListLive, move: Move, *, passes: int, alone_after: int = 2,
             failures: tuple[type[BaseException], ...] = (MigrationError,)) -> Relocation:
    """Sweep the source: move what `live_sessions()` lists, at most `passes` times, until it lists
    nothing the sweep has not given up on. A move's failure in `failures` is recorded and tried
    again; a listing that fails ends the sweep with `source_error` (an unreachable source is not
    "nothing left"), keeping what the moves so far did."""
    rel = Relocation()

    def listed() -> list[str] | None:
        try:
            return list(live_sessions())
        except Exception as e:  # noqa: BLE001 - whatever stops the listing, the moves so far stand
            rel.source_error = f"listing the source's sessions: {type(e).__name__}: {e}"
            rel.errors.append(rel.source_error)
            return None

    strikes = 0
    for _ in range(passes):
        if (now := listed()) is None:
            return rel
        ids = [s for s in now if s not in rel.not_moved]
        if not ids:
            break
        for group in ([ids] if strikes < alone_after else [[s] for s in ids]):
            try:
                mr = move(group)
            except failures as err:
                # failed after its commit: those sessions live on the target now
                committed = list(getattr(err, "committed_sessions", None) or [])
                rel._add_moved(committed)
                rel.errors.append(str(err))
                for sid in set(group) - set(committed):
                    rel.last_error[sid] = str(err)
                if len(group) == 1 and not committed:
                    rel.not_moved[group[0]] = str(err)
                elif len(group) > 1:
                    strikes += 1
                continue
            rel.migrations.append(mr)
            rel._add_moved(mr.sessions)
            kept = mr.kept()  # the source's word on each one it did not move
            for sid, why in mr.not_moved.items():
                if sid in kept:  # its engine keeps it: no later pass would move it
                    rel.not_moved[sid] = why
                elif sid not in rel.finished_here:
                    rel.finished_here.append(sid)
    if (now := listed()) is not None:
        rel.left = [s for s in now if s not in rel.moved]
    return rel
