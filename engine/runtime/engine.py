"""LLMEngine: sessions in, tokens out, one step at a time (token ids only; no HTTP here)."""

from __future__ import annotations

import math
import secrets
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from relayout.engine.kv_cache import BLOCK_SIZE, BlockAllocator, blocks_needed, kv_storage_dtype
from relayout.engine.model.config import ModelConfig, parse_dtype, parse_kv_dtype
from relayout.engine.model.layout import Layout
from relayout.engine.ranks.executor import Executor, LocalExecutor
from relayout.engine.ranks.runner import StepBatch, kv_block_bytes
from relayout.engine.runtime.logprobs import LogprobRecord, token_logprobs
from relayout.engine.runtime.sampling import new_rng_state, sample
from relayout.engine.runtime.scheduler import Scheduler
from relayout.engine.runtime.session import SamplingParams, SessionState, SessionStatus
from relayout.storage.settings import settings

if TYPE_CHECKING:
    from relayout.engine.model.tokenizer import Tokenizer
    from relayout.engine.ranks.workers import RankPlacement



class RequestError(ValueError):
    """A request that can never be served (caller's mistake): maps to HTTP 400."""


@dataclass
class TokenEvent:
    session_id: str
    token_id: int
    finished: bool
    finish_reason: str | None


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def running_sessions(sessions: dict[str, SessionState], session_ids: list[str]) -> list[SessionState]:
    """The named sessions, each still running here (KeyError naming the first that is not): what a
    pause (a checkpoint with stop, a migration's cutover) may hold, in either engine."""
    out = []
    for sid in session_ids:
        s = sessions.get(sid)
        if s is None or s.is_finished:
            raise KeyError(f"session {sid} is not running on this replica")
        out.append(s)
    return out


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """RequestError for a request no replica of this model could serve (any engine)."""
    if not prompt_token_ids:
        raise RequestError("prompt is empty")
    if any((not isinstance(t, int)) or t < 0 or t >= vocab_size for t in prompt_token_ids):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    if params.max_tokens < 1:
        raise RequestError("max_tokens must be at least 1")
    # NaN passes `< 0` (and JSON bodies may carry NaN and Infinity): admitted, it failed the engine's next
    # step for every session of the replica
    if not (math.isfinite(params.temperature) and params.temperature >= 0) or not 0 < params.top_p <= 1:
        raise RequestError("temperature must be a finite number >= 0 and top_p in (0, 1]")
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise RequestError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"this replica's context limit of {max_model_len} tokens"
        )


def finish_reason_after(s: SessionState, tok: int, tokenizer: Tokenizer) -> str | None:
    """Why the session ends with `tok` just appended (None: it goes on): the same rules on every engine."""
    p = s.sampling
    if not p.ignore_eos and tok in tokenizer.eos_token_ids:
        return "stop"
    if tok in p.stop_token_ids:
        return "stop"
    if p.stop:
        longest = max(len(x) for x in p.stop)
        tail = tokenizer.decode(s.output_token_ids[-(longest + 8):])
        if any(x in tail for x in p.stop):
            return "stop"
    if len(s.output_token_ids) >= p.max_tokens:
        return "length"
    return None


class LLMEngine:
    engine_name = "builtin"

    def __init__(self, model: str, layout: Layout | str | None = None, *, kv_cache_bytes: int | None = None,
                 num_blocks: int | None = None, device: str | None = None, dtype: torch.dtype | str | None = None,
                 kv_dtype: str | None = None, max_num_seqs: int = 64, max_prefill_tokens: int = 512,
                 max_finished: int = 4096, placement: RankPlacement | None = None):
        """`dtype`: weights and activations (float32, bfloat16, float16; None: bfloat16 on CUDA,
        float32 on the CPU). `kv_dtype`: "auto" (the model dtype) or "fp8_e4m3"."""
        from relayout.engine.model.tokenizer import load_tokenizer
        from relayout.engine.model.weights import resolve_model

        self.device = pick_device(device)
        # names checked before anything loads: a bad one is the caller's mistake, said at once
        self.dtype = dtype = parse_dtype(dtype, self.device)
        self.kv_dtype_name = parse_kv_dtype(kv_dtype)
        self.kv_dtype = kv_storage_dtype(self.kv_dtype_name, dtype)  # the KV pool's element type
        if self.kv_dtype_name != "auto" and self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"kv_dtype {self.kv_dtype_name} needs a CPU or CUDA device, not {self.device.type}")
        self.model_ref = model
        self.model_dir = resolve_model(model)
        self.cfg = ModelConfig.from_dir(self.model_dir)
        self.layout = (layout if isinstance(layout, Layout) else Layout.parse(layout)).validate(self.cfg)
        self.tokenizer = load_tokenizer(self.model_dir, self.cfg)
        lay = self.layout
        kv_heads = lay.kv_head_range(0, self.cfg.num_kv_heads)
        per_block = kv_block_bytes(self.cfg, kv_heads[1] - kv_heads[0], self.kv_dtype)
        self.num_blocks = num_blocks or max(4, (kv_cache_bytes or settings().kv_bytes) // per_block)
        self.max_model_len = min(self.cfg.max_position_embeddings, self.num_blocks * BLOCK_SIZE - 1)
        self.allocators = [BlockAllocator(self.num_blocks) for _ in range(lay.attn_dp)]
        self.scheduler = Scheduler(self.allocators, max_num_seqs, max_prefill_tokens)
        self.sessions: dict[str, SessionState] = {}
        self.held_tokens: dict[str, tuple[int, LogprobRecord | None]] = {}  # session -> its pre-step's token (prestep)
        self.max_finished = max_finished
        self.executor: Executor
        if lay.world_size == 1 and (placement is None or placement.local_ranks in (None, [0])):
            self.executor = LocalExecutor(self.cfg, lay, self.model_dir, self.num_blocks, self.device, dtype,
                                          self.kv_dtype)
        else:
            from relayout.engine.ranks.workers import RankExecutor

            self.executor = RankExecutor(self.cfg, lay, self.model_dir, self.num_blocks, self.device, dtype,
                                         placement, kv_dtype=self.kv_dtype)
        self.num_steps = 0
        self.tokens_generated = 0
        self._fingerprint: str | None = None
        # hashed now, off the engine thread: the first checkpoint or migration round would wait for it
        threading.Thread(target=lambda: self.fingerprint, name="model-fingerprint", daemon=True).start()
        # tests use this to compare logits with a reference implementation
        self.logits_hook: Callable[[str, torch.Tensor], None] | None = None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            from relayout.engine.model.weights import model_fingerprint

            self._fingerprint = model_fingerprint(self.model_dir)
        return self._fingerprint

    # ---- sessions ----------------------------------------------------------
    def add_session(self, prompt_token_ids: list[int], params: SamplingParams, session_id: str | None = None) -> SessionState:
        check_request(prompt_token_ids, params, self.cfg.vocab_size, self.max_model_len)
        sid = session_id or f"cmpl-{uuid.uuid4().hex}"
        if sid in self.sessions:
            raise RequestError(f"session {sid} already exists")
        s = SessionState(session_id=sid, prompt_token_ids=list(prompt_token_ids), sampling=params)
        if not params.greedy:
            # unseeded requests get a random seed now, so the session stays reproducible after a move
            s.rng_state = new_rng_state(params.seed if params.seed is not None else secrets.randbits(63))
        self.sessions[sid] = s
        self.scheduler.add(s)
        return s

    def get(self, session_id: str) -> SessionState | None:
        return self.sessions.get(session_id)

    def abort(self, session_id: str, reason: str = "abort") -> None:
        s = self.sessions.get(session_id)
        if s is None or s.is_finished:
            return
        self._finish(s, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def pause(self, session_ids: list[str]) -> None:
        """Hold sessions at this step boundary (checkpoint with stop, migration cutover)."""
        for s in running_sessions(self.sessions, session_ids):
            self.scheduler.pause(s)

    def resume(self, session_ids: list[str]) -> None:
        """Let paused sessions run again (unknown or not paused ones are skipped). A token a
        session's pre-step computed while it was held is its next token now."""
        for sid in session_ids:
            s = self.sessions.get(sid)
            self.scheduler.prestep.discard(sid)
            held = self.held_tokens.pop(sid, None)
            if s is None:
                continue
            if held is not None and s.status == SessionStatus.PAUSED:
                tok, lp = held
                s.num_computed += 1
                if lp is not None:
                    s.logprobs.append(lp)
                self._append(s, tok)  # may finish it (a stop token, max_tokens): then it stays finished
            self.scheduler.resume(s)

    def prestep(self, session_ids: list[str]) -> None:
        """Sessions just placed here, held until a migration's commit, each compute their next token
        now, in the next step, instead of after the commit: the commit's round trips then overlap
        that step, which is most of a migrated session's stall. The token is kept back (no event, not
        in the session's tokens, its position not counted as computed) until `resume`; a session
        discarded instead (the migration aborted) never produced it. Only sessions whose every token
        but the last has KV here take part (a decode step)."""
        for sid in session_ids:
            s = self.sessions.get(sid)
            if s is not None and s.status == SessionStatus.PAUSED and s.num_tokens - s.num_computed == 1:
                self.scheduler.prestep.add(sid)

    def release(self, session_ids: list[str], status: SessionStatus = SessionStatus.MIGRATED) -> None:
        """The sessions live elsewhere now (a migration's commit, a checkpoint with stop): free them."""
        for sid in session_ids:
            s = self.sessions.get(sid)
            if s is not None and not s.is_finished:
                self._finish(s, s.finish_reason or "migrated", status)

    def adopt(self, s: SessionState, group: int, blocks: list[int] | None) -> None:
        """Take in a session that arrived from elsewhere (restore, live transfer). With `blocks`
        (already holding its first `s.num_computed` tokens of KV) it is placed in that group's
        running set in its current status; without, it queues to be prefilled from scratch."""
        s.dp_group = group
        self.sessions[s.session_id] = s
        if blocks is None:
            self.scheduler.add(s)
        else:
            self.scheduler.place(s, group, blocks)

    def discard(self, session_id: str) -> None:
        """Forget a session that never became this replica's (an uncommitted transfer), freeing its blocks."""
        self.held_tokens.pop(session_id, None)
        s = self.sessions.pop(session_id, None)
        if s is not None:
            self.scheduler.remove(s)

    def _finish(self, s: SessionState, reason: str, status: SessionStatus = SessionStatus.FINISHED) -> None:
        self.held_tokens.pop(s.session_id, None)
        s.status = status
        s.finish_reason = reason if status == SessionStatus.FINISHED else s.finish_reason
        self.scheduler.remove(s)
        self._trim_finished()

    def _trim_finished(self) -> None:
        done = [k for k, v in self.sessions.items() if v.is_finished]
        for k in done[: max(0, len(done) - self.max_finished)]:
            del self.sessions[k]

    # ---- one step ------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.schedule()
        if not any(plan):
            return []
        batches: list[StepBatch] = []
        for seqs in plan:
            b = StepBatch()
            for x in seqs:
                s = x.session
                table = self.scheduler.tables[s.session_id]
                start = s.num_computed
                n_prompt = len(s.prompt_token_ids)
                for pos in range(start, start + x.num_new):
                    # index prompt and output in place: concatenating them would cost O(context)
                    # per session on every decode step
                    b.input_ids.append(s.prompt_token_ids[pos] if pos < n_prompt else s.output_token_ids[pos - n_prompt])
                    b.positions.append(pos)
                    b.slot_mapping.append(table.slot(pos))
                b.query_lens.append(x.num_new)
                b.context_lens.append(start + x.num_new)
                b.block_tables.append(list(table.blocks[: blocks_needed(start + x.num_new)]))
                if x.sample:
                    b.logits_at.append(len(b.input_ids) - 1)
            batches.append(b)
        logits = self.executor.execute(batches)
        self.num_steps += 1
        events: list[TokenEvent] = []
        for g, seqs in enumerate(plan):
            # greedy picks of every row in one argmax and one sync, not one per session
            greedy = (logits[g].argmax(-1).tolist() if any(x.sample and x.session.sampling.greedy for x in seqs)
                      else [])
            row = 0
            for x in seqs:
                s = x.session
                held = s.status == SessionStatus.PAUSED  # a pre-step (see prestep): counted at resume
                if not held:
                    s.num_computed += x.num_new
                if s.status == SessionStatus.WAITING:
                    s.status = SessionStatus.RUNNING
                if not x.sample:
                    continue
                if self.logits_hook is not None:
                    self.logits_hook(s.session_id, logits[g][row])
                tok = greedy[row] if s.sampling.greedy else sample(logits[g][row], s)
                lp = None
                if s.sampling.logprobs is not None:  # only sessions that asked pay for it
                    lp = token_logprobs(logits[g][row], tok, s.sampling.logprobs)
                row += 1
                if held:
                    self.scheduler.prestep.discard(s.session_id)
                    self.held_tokens[s.session_id] = (tok, lp)
                    continue
                if lp is not None:
                    s.logprobs.append(lp)
                events.append(self._append(s, tok))
        return events

    def _append(self, s: SessionState, tok: int) -> TokenEvent:
        s.output_token_ids.append(tok)
        self.tokens_generated += 1
        reason = finish_reason_after(s, tok, self.tokenizer)
        if reason is not None:
            self._finish(s, reason)
        return TokenEvent(s.session_id, tok, reason is not None, reason)

    # ---- convenience -----------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        ps = params if isinstance(params, list) else [params] * len(prompts)
        ss = [self.add_session(p, q) for p, q in zip(prompts, ps, strict=True)]
        while self.has_work():
            self.step()
        return [s.output_token_ids for s in ss]

    def engine_info(self) -> dict:
        """Which engine serves this replica (GET /v1/replica)."""
        from importlib.metadata import version

        return {"engine": self.engine_name, "engine_version": version("relayout")}

    def expert_stats(self) -> dict:
        """Per layer, tokens routed to each logical expert; all-to-all bytes between rank pairs;
        per layer exposed vs total exchange seconds."""
        per_rank = self.executor.moe_stats()
        L, W = self.cfg.num_layers, self.layout.world_size
        # what a pair carries in the exchange (engine.model.moe): its hidden state and its slot in one more element
        pair = (self.cfg.hidden_size + 1) * self.dtype.itemsize
        counts = [[0] * self.cfg.num_experts for _ in range(L)]
        for r in per_rank:
            for layer, row in enumerate(r["expert_counts"]):
                for e, c in enumerate(row):
                    counts[layer][e] += c
        return {
            "expert_counts": counts,
            "a2a_bytes": [[sum(r["bytes_to"][layer][d] for layer in range(L)) for d in range(self.layout.world_size)]
                          for r in per_rank],
            # per layer, (token, expert) pairs each rank sent to each rank, and each rank's experts computed
            "rank_pairs_from": [[[r["bytes_to"][layer][d] // pair for d in range(W)] for r in per_rank]
                                for layer in range(L)],
            "rank_pairs": [[sum(r["bytes_to"][layer][d] for r in per_rank) // pair for d in range(W)]
                           for layer in range(L)],
            "exposed_s": [max(r["exposed_s"][layer] for r in per_rank) for layer in range(L)],
            "total_s": [max(r["total_s"][layer] for r in per_rank) for layer in range(L)],
        }

    def kv_blocks_used(self) -> int:
        return sum(a.num_used for a in self.allocators)

    def shutdown(self) -> None:
        self.executor.shutdown()
