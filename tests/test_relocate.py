"""`migrate.protocol.relocate`: the one sweep loop of the controller, the fleet and a drain, driven here by a
scripted source (what it lists on each pass, how each move ends); the real moves are tested with
replicas in test_policy, test_fleet_controller and test_drain."""

from __future__ import annotations

from relayout.migrate.protocol.live import FINISHED_ON_SOURCE, MigrationError, MigrationResult
from relayout.migrate.protocol.relocate import relocate


class Source:
    """Sessions live on a source; a move takes them off it unless the script says otherwise."""

    def __init__(self, live: list[str], fail: dict[frozenset[str], int] | None = None,
                 keep: dict[str, str] | None = None, arrive: list[list[str]] | None = None) -> None:
        self.live, self.fail, self.keep = list(live), dict(fail or {}), dict(keep or {})
        self.arrive = list(arrive or [])  # sessions that arrive after each move
        self.moves: list[list[str]] = []

    def list(self) -> list[str]:
        return list(self.live)

    def move(self, ids: list[str]) -> MigrationResult:
        self.moves.append(list(ids))
        if self.arrive:
            self.live += self.arrive.pop(0)
        if self.fail.get(frozenset(ids), 0) > 0:
            self.fail[frozenset(ids)] -= 1
            raise MigrationError("stop-and-copy", f"cannot move {sorted(ids)}")
        moved = [s for s in ids if s not in self.keep]
        self.live = [s for s in self.live if s not in moved]
        return MigrationResult(transfer_id=f"t{len(self.moves)}", sessions=moved,
                               not_moved={s: self.keep[s] for s in ids if s in self.keep})


def test_each_pass_lists_again_so_late_arrivals_move_too():
    src = Source(["a", "b"], arrive=[["c"], []])
    rel = relocate(src.list, src.move, passes=3)
    assert src.moves == [["a", "b"], ["c"]]
    assert rel.moved == ["a", "b", "c"] and rel.left == [] and rel.errors == [] and len(rel.migrations) == 2


def test_after_two_failed_group_moves_sessions_move_one_by_one():
    src = Source(["a", "bad", "c"], fail={frozenset(["a", "bad", "c"]): 9, frozenset(["bad"]): 9})
    rel = relocate(src.list, src.move, passes=4)
    assert src.moves[:3] == [["a", "bad", "c"], ["a", "bad", "c"], ["a"]]
    assert sorted(rel.moved) == ["a", "c"] and list(rel.not_moved) == ["bad"] and rel.left == ["bad"]
    assert "cannot move ['bad']" in rel.not_moved["bad"] and len(rel.errors) == 3
    assert ["bad"] not in src.moves[4:], "a session given up on is not asked again"


def test_a_kept_session_is_named_and_not_asked_again_a_finished_one_is_named_too():
    src = Source(["a", "seeded"], keep={"seeded": "the engine keeps a seeded request"})
    src.live.append("done")  # listed once, then it ends on the source before the final round
    real = src.move

    def move(ids: list[str]) -> MigrationResult:
        res = real([s for s in ids if s != "done"])
        if "done" in ids:
            src.live.remove("done")
            res.not_moved["done"] = FINISHED_ON_SOURCE
        return res
    rel = relocate(src.list, move, passes=5)
    assert src.moves == [["a", "seeded"]]
    assert rel.moved == ["a"] and rel.finished_here == ["done"]
    assert rel.not_moved == {"seeded": "the engine keeps a seeded request"} and rel.left == ["seeded"]


def test_a_failed_move_after_its_commit_counts_its_sessions_moved():
    def move(ids: list[str]) -> MigrationResult:
        raise MigrationError("committed", "the target's answer was lost", committed_sessions=["a"])
    live = iter([["a"], [], []])
    rel = relocate(lambda: next(live), move, passes=3)
    assert rel.moved == ["a"] and rel.not_moved == {} and rel.left == [] and len(rel.errors) == 1


def test_a_source_that_stops_answering_ends_the_sweep_and_keeps_what_moved():
    calls = iter([["a", "b"]])

    def listing() -> list[str]:
        try:
            return next(calls)
        except StopIteration:
            raise ConnectionError("source gone") from None
    src = Source(["a", "b"])
    rel = relocate(listing, src.move, passes=3)
    assert rel.moved == ["a", "b"] and rel.source_error and "source gone" in rel.source_error
    assert rel.left == []  # unknown: the caller reports source_error, not "nothing left"


def test_no_passes_only_lists_what_is_left():
    src = Source(["a"])
    rel = relocate(src.list, src.move, passes=0)
    assert src.moves == [] and rel.left == ["a"]
