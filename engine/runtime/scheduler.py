"""Continuous batching: every step, running sessions decode and waiting ones prefill (in chunks)
into the same batch; admission is by free KV blocks.

Preemption policy: when a running session needs a block and its pool is empty, the most
recently admitted session of that pool is preempted by recomputation — its blocks are
freed and it goes back to the front of the queue, keeping its generated tokens and RNG
state, so its output is unchanged (only delayed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from relayout.engine.kv_cache import BlockAllocator, KVBlockTable, blocks_needed
from relayout.engine.runtime.session import SessionState, SessionStatus


@dataclass
class ScheduledSeq:
    session: SessionState
    num_new: int  # tokens computed this step
    sample: bool  # whether this step completes its context, so a token is sampled


class Scheduler:
    def __init__(self, allocators: list[BlockAllocator], max_num_seqs: int = 64, max_prefill_tokens: int = 512):
        self.allocators = allocators
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[SessionState] = deque()
        self.paused_waiting: list[SessionState] = []  # paused before they were admitted
        self.running: list[list[SessionState]] = [[] for _ in allocators]
        self.tables: dict[str, KVBlockTable] = {}
        self.num_preemptions = 0
        # paused sessions allowed one decode step while held (LLMEngine.prestep): its token is kept back
        self.prestep: set[str] = set()

    # ---- membership ------------------------------------------------------
    def add(self, s: SessionState) -> None:
        self.waiting.append(s)

    def group_load(self, g: int) -> int:
        return len(self.running[g])

    def place(self, s: SessionState, group: int, blocks: list[int]) -> None:
        """Put a session that already has KV (restored or migrated in) straight into running."""
        s.dp_group = group
        self.tables[s.session_id] = KVBlockTable(blocks)
        self.running[group].append(s)

    def remove(self, s: SessionState) -> None:
        """Forget a session and free its blocks (finished, aborted, or moved away)."""
        self.prestep.discard(s.session_id)
        if s in self.waiting:
            self.waiting.remove(s)
        if s in self.paused_waiting:
            self.paused_waiting.remove(s)
        for g, run in enumerate(self.running):
            if s in run:
                run.remove(s)
                t = self.tables.pop(s.session_id, None)
                if t is not None:
                    self.allocators[g].free(t.blocks)

    def pause(self, s: SessionState) -> None:
        """Hold a session at this step boundary: a waiting one leaves the admission queue."""
        if s in self.waiting:
            self.waiting.remove(s)
            self.paused_waiting.append(s)
        s.status = SessionStatus.PAUSED

    def resume(self, s: SessionState) -> None:
        """Undo `pause`: one paused before admission goes back to the front of the queue."""
        if s.status != SessionStatus.PAUSED:
            return
        if s in self.paused_waiting:
            self.paused_waiting.remove(s)
            s.status = SessionStatus.WAITING
            self.waiting.appendleft(s)
        else:
            s.status = SessionStatus.RUNNING if s.num_computed else SessionStatus.WAITING

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.prestep) or any(
            s.status in (SessionStatus.RUNNING, SessionStatus.WAITING) for run in self.running for s in run
        )

    # ---- one step ---------------------------------------------------------
    def schedule(self) -> list[list[ScheduledSeq]]:
        out: list[list[ScheduledSeq]] = [[] for _ in self.allocators]
        # 1. running sessions continue (decode, or the next chunk of their prefill)
        budget = [self.max_prefill_tokens] * len(self.allocators)
        for g, run in enumerate(self.running):
            for s in list(run):
                if s not in run or s.is_finished:
                    continue
                if s.status == SessionStatus.PAUSED and s.session_id not in self.prestep:
                    continue  # (LLMEngine.prestep admits only sessions one decode step from their next token)
                todo = s.num_tokens - s.num_computed
                n = todo if todo == 1 else min(todo, max(budget[g], 1))
                if not self._grow(g, s, s.num_computed + n, out[g]):
                    continue
                budget[g] -= n if todo > 1 else 0
                out[g].append(ScheduledSeq(s, n, s.num_computed + n == s.num_tokens))
        # 2. admit waiting sessions to the least-loaded pool that can hold their whole context
        while self.waiting:
            s = self.waiting[0]
            need = blocks_needed(s.num_tokens + 1)
            groups = sorted(range(len(self.allocators)), key=lambda g: (len(self.running[g]), g))
            g = next((g for g in groups if self.allocators[g].can_allocate(need)
                      and len(self.running[g]) < self.max_num_seqs and budget[g] > 0), None)
            if g is None:
                break
            self.waiting.popleft()
            s.dp_group = g
            s.status = SessionStatus.WAITING
            self.tables[s.session_id] = KVBlockTable(self.allocators[g].allocate(need))
            self.running[g].append(s)
            n = min(s.num_tokens - s.num_computed, budget[g])
            budget[g] -= n
            out[g].append(ScheduledSeq(s, n, s.num_computed + n == s.num_tokens))
        return out

    def _grow(self, g: int, s: SessionState, upto: int, scheduled: list[ScheduledSeq]) -> bool:
        table = self.tables[s.session_id]
        need = blocks_needed(upto) - len(table.blocks)
        while need > 0 and not self.allocators[g].can_allocate(need):
            victim = self._victim(g, s, scheduled)
            if victim is None:
                return False
            self._preempt(victim)
        if need > 0:
            table.blocks += self.allocators[g].allocate(need)
        return True

    def _victim(self, g: int, s: SessionState, scheduled: list[ScheduledSeq]) -> SessionState | None:
        taken = {x.session.session_id for x in scheduled}
        for v in reversed(self.running[g]):
            if v is not s and v.status != SessionStatus.PAUSED and v.session_id not in taken:
                return v
        return None

    def _preempt(self, v: SessionState) -> None:
        self.remove(v)
        v.num_computed = 0
        v.status = SessionStatus.WAITING
        self.waiting.appendleft(v)
        self.num_preemptions += 1

