"""A stock vLLM server as the engine of a relayout replica: the same session surface as
engine.runtime.engine.LLMEngine (sessions, add/abort/pause/resume/release, step), so engine.runtime.async_engine,
the OpenAI routes, session streams and the migration protocol serve it unchanged.

Each session is one vLLM request, streamed from vLLM's own `/v1/completions` with token ids; vLLM
schedules and computes, this class keeps the `SessionState` (what was generated, what the client
was sent) and decides when a session ends by the same rules as the builtin engine (EOS, stop ids
and strings, max_tokens), so a session behaves the same on either engine and after any move.

Holding a session at a step boundary (`pause`) freezes its state here while vLLM may run a step
or two ahead: tokens that arrive meanwhile are kept back and become the session's on `resume`, or
are dropped on `release` (the request is aborted in vLLM, and its KV up to the frozen state is what
moved). The KV itself goes in and out through relayout's KV connector (engine.vllm.connector), as
files in the replica's exchange directory (engine.vllm.exchange).

A load's staged files belong to the session's vLLM request: they are removed once that request has
produced a token (its KV is in vLLM's cache, or vLLM recomputed it), or when it ends; a worker that
could not load them leaves `<load id>.failed`, and the session is then named in `recomputed`."""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from relayout.engine.model.config import ModelConfig, parse_dtype
from relayout.engine.model.layout import Layout, LayoutError
from relayout.engine.model.tokenizer import load_tokenizer
from relayout.engine.model.weights import resolve_model
from relayout.engine.runtime.engine import (
    RequestError,
    TokenEvent,
    check_request,
    finish_reason_after,
    pick_device,
    running_sessions,
)
from relayout.engine.runtime.sampling import new_rng_state
from relayout.engine.runtime.session import SamplingParams, SessionState, SessionStatus
from relayout.engine.vllm.exchange import Exchange, ExchangeError, KVFile, control
from relayout.engine.vllm.server import AttachedVllm, VllmLaunch, VllmServer, vllm_version
from relayout.engine.vllm.stream import Arrival, stream_completion

STEP_WAIT_S = 0.01  # step() waits this long for vLLM's next tokens: calls queued meanwhile wait as long
EXPORT_TIMEOUT_S = 60.0
log = logging.getLogger("relayout.vllm_engine")


class VllmEngineDead(RuntimeError):
    """The vLLM server of this replica exited."""


@dataclass
class _Request:
    """The vLLM request serving one session now."""

    generation: int
    task: asyncio.Future | None = None
    held: list[Arrival] = field(default_factory=list)  # arrived while the session was paused


class VllmEngine:
    engine_name = "vllm"

    def __init__(self, model: str, layout: Layout | str | None = None, *, dtype: str | None = None,
                 kv_cache_mb: int | None = None, host: str = "127.0.0.1", vllm_args: list[str] | None = None,
                 max_finished: int = 4096, attach: str | None = None, exchange: str | Path | None = None):
        """Start a vLLM server for `model`, or with `attach` (its URL) serve in front of one the user
        started with relayout's connector on `exchange` (`relayout vllm-config --exchange DIR`)."""
        self.model_ref = model
        self.model_dir = resolve_model(model)
        self.cfg = ModelConfig.from_dir(self.model_dir)
        self.device = pick_device(None)
        self.tokenizer = load_tokenizer(self.model_dir, self.cfg)
        self.attached = attach is not None
        if self.attached:
            self.exchange = Exchange.open(exchange) if exchange else None
            if self.exchange is None:
                raise ExchangeError("--attach needs --exchange DIR: the directory vLLM's relayout connector uses")
            self.server: VllmServer | AttachedVllm = AttachedVllm(attach)
            info = self.server.wait_ready()
            self.model_ref = str(info.get("id") or model)  # requests name vLLM's served model
            geo = self._ping_attached()
            ranks = int(geo.get("ranks") or 1)
            self.layout = (Layout.parse(layout) if layout else
                           Layout(attn_tp=ranks, moe_tp=ranks)).validate(self.cfg)
            if self.layout.attn_tp != ranks:
                raise LayoutError("attn_tp", f"the attached vLLM runs tensor-parallel {ranks}, the layout says "
                                             f"{self.layout.attn_tp}")
            self.dtype = getattr(torch, geo.get("kv_dtype") or "float32")
        else:
            self.layout = (layout if isinstance(layout, Layout) else Layout.parse(layout)).validate(self.cfg)
            self.dtype = parse_dtype(dtype, self.device)
            self.exchange = Exchange.create()
            self.launch = VllmLaunch(self.model_dir, model, self.layout, str(self.dtype).removeprefix("torch."),
                                     self.exchange.dir, kv_cache_mb, host, 0, list(vllm_args or []))
            try:
                self.server = VllmServer(self.launch)
                info = self.server.wait_ready()
                # the KV dtype is vLLM's to choose: what its kv_cache_config says, not what the model config does
                geo = control(self.exchange.control_socket, {"op": "ping"}, timeout=30)
            except BaseException:
                if hasattr(self, "server"):
                    self.server.stop()
                self.exchange.remove()
                raise
        self.kv_dtype_name, self.kv_dtype = "auto", self.dtype
        if geo.get("kv_dtype"):
            self.kv_dtype = getattr(torch, geo["kv_dtype"])
            self.kv_dtype_name = geo["kv_dtype"] if self.kv_dtype != self.dtype else "auto"
        self.staging = self.exchange.dir
        self.engine_url = self.server.url
        self.engine_version = vllm_version()
        self.max_model_len = int(info.get("max_model_len") or self.cfg.max_position_embeddings)
        self.num_blocks = 0  # vLLM's pool is its own (its /metrics says how full)
        self.sessions: dict[str, SessionState] = {}
        self.max_finished = max_finished
        self.num_steps = 0
        self.tokens_generated = 0
        self._requests: dict[str, _Request] = {}
        self._loads: dict[str, dict | None] = {}  # adopted sessions' KV to load, until their request starts
        self._staged: dict[str, tuple[int, dict]] = {}  # session -> (request generation, load) not yet settled
        self.recomputed: dict[str, str] = {}  # session -> why its KV load failed and vLLM recomputed it
        self._arrivals: queue.Queue[Arrival] = queue.Queue()
        self._fingerprint: str | None = None
        threading.Thread(target=lambda: self.fingerprint, name="model-fingerprint", daemon=True).start()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="vllm-streams", daemon=True)
        self._loop_thread.start()
        self._client = self._on_loop(self._new_client()).result()

    def _ping_attached(self) -> dict:
        """The attached vLLM's connector, or why it cannot be attached (saying what to add to vLLM)."""
        try:
            return control(self.exchange.control_socket, {"op": "ping"}, timeout=10)
        except ExchangeError as e:
            raise ExchangeError(
                f"the vLLM at {self.server.url} does not run relayout's connector on {self.exchange.dir} ({e}): "
                f"start it with --kv-transfer-config \"$(relayout vllm-config --exchange {self.exchange.dir})\"") from None

    async def _new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.engine_url, timeout=httpx.Timeout(None, connect=10.0),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            from relayout.engine.model.weights import model_fingerprint

            self._fingerprint = model_fingerprint(self.model_dir)
        return self._fingerprint

    def engine_info(self) -> dict:
        return {"engine": self.engine_name, "engine_version": self.engine_version, "engine_url": self.engine_url}

    # ---- sessions ------------------------------------------------------------------------------
    def add_session(self, prompt_token_ids: list[int], params: SamplingParams, session_id: str | None = None
                    ) -> SessionState:
        check_request(prompt_token_ids, params, self.cfg.vocab_size, self.max_model_len)
        sid = session_id or f"cmpl-{uuid.uuid4().hex}"
        if sid in self.sessions:
            raise RequestError(f"session {sid} already exists")
        s = SessionState(session_id=sid, prompt_token_ids=list(prompt_token_ids), sampling=params)
        if not params.greedy:  # as the builtin engine: a sampled session carries its RNG to a builtin target
            s.rng_state = new_rng_state(params.seed if params.seed is not None else secrets.randbits(63))
        self.sessions[sid] = s
        self._submit(s)
        return s

    def get(self, session_id: str) -> SessionState | None:
        return self.sessions.get(session_id)

    def abort(self, session_id: str, reason: str = "abort") -> None:
        s = self.sessions.get(session_id)
        if s is not None and not s.is_finished:
            self._finish(s, reason)

    def has_work(self) -> bool:
        # paused sessions too: their requests still stream (held back), and step() must read them
        # and a dead vLLM: step() says so
        return not self.server.alive or any(not s.is_finished for s in self.sessions.values())

    def pause(self, session_ids: list[str]) -> None:
        for s in running_sessions(self.sessions, session_ids):
            s.status = SessionStatus.PAUSED

    def resume(self, session_ids: list[str]) -> None:
        """Paused sessions run again: what vLLM computed meanwhile is theirs now. A session placed
        here by a restore or a migration that has no vLLM request yet gets one, loading its KV."""
        for sid in session_ids:
            s = self.sessions.get(sid)
            if s is None or s.status != SessionStatus.PAUSED:
                continue
            s.status = SessionStatus.RUNNING
            req = self._requests.get(sid)
            if req is None:
                self._submit(s, self._loads.pop(sid, None))
                continue
            held, req.held = req.held, []
            for a in held:
                self._apply(s, a)

    def release(self, session_ids: list[str], status: SessionStatus = SessionStatus.MIGRATED) -> None:
        for sid in session_ids:
            s = self.sessions.get(sid)
            if s is not None and not s.is_finished:
                self._finish(s, s.finish_reason or "migrated", status)

    def adopt(self, s: SessionState, load: dict | None) -> None:
        """Take in a session that arrived (restore, live transfer), paused: it runs at `resume`,
        its vLLM request loading `load` (engine.vllm.exchange LOAD_KEY) instead of recomputing it."""
        s.status = SessionStatus.PAUSED
        self.sessions[s.session_id] = s
        self._loads[s.session_id] = load

    def discard(self, session_id: str) -> None:
        """Forget a session that never became this replica's (an uncommitted transfer)."""
        self._unstage(self._loads.pop(session_id, None))
        self._cancel(session_id)
        self.sessions.pop(session_id, None)

    # ---- staged loads ----------------------------------------------------------------------------
    def _unstage(self, load: dict | None) -> None:
        """Remove a load's staged files (and a worker's note that it failed)."""
        if not load:
            return
        names = [f["name"] for f in load.get("files") or []]
        if load.get("id"):
            names.append(f"{load['id']}.failed")
        for name in names:
            (self.exchange.dir / name).unlink(missing_ok=True)

    def _settle(self, sid: str, generation: int) -> None:
        """The request that loaded `sid`'s staged KV produced a token: the KV is in vLLM's cache (or a
        worker could not load it and vLLM recomputed it: named in `recomputed`); the files go."""
        staged = self._staged.get(sid)
        if staged is None or staged[0] != generation:
            return
        load = staged[1]
        note = self.exchange.dir / f"{load['id']}.failed"
        if note.exists():
            self.recomputed[sid] = why = note.read_text()
            log.warning("session %s: vLLM could not load its KV and recomputed it: %s", sid, why)
        del self._staged[sid]  # after the outcome: a restore waiting on another thread reads it once this is gone
        self._unstage(load)

    def load_pending(self, sid: str) -> bool:
        """Whether the session's request has yet to take its staged KV (it is placed and still runs)."""
        s = self.sessions.get(sid)
        return sid in self._staged and s is not None and not s.is_finished

    # ---- KV out of vLLM ------------------------------------------------------------------------
    def export_kv(self, session_id: str, lo: int, hi: int) -> list[KVFile]:
        """KV tokens [lo, hi) of a session's running vLLM request, one file per distinct KV-head range
        (each TP rank's). Any thread; ExchangeError if vLLM no longer runs the request."""
        out = self.exchange.new_dir("x-")
        try:
            ans = control(self.exchange.control_socket, {"op": "export", "session": session_id, "lo": lo, "hi": hi,
                                                          "dir": out.name}, timeout=EXPORT_TIMEOUT_S)
            ranks = int(ans["ranks"])
            deadline = time.monotonic() + EXPORT_TIMEOUT_S
            while len(files := sorted(out.glob("rank*.safetensors"))) < ranks:
                if errors := sorted(out.glob("*.error")):
                    raise ExchangeError(f"vLLM's worker could not export session {session_id}'s KV: "
                                        f"{errors[0].read_text()}")
                if time.monotonic() > deadline or not self.server.alive:
                    raise ExchangeError(f"vLLM's workers did not write session {session_id}'s KV "
                                        f"({len(files)} of {ranks} ranks)")
                time.sleep(0.002)
            seen: dict[tuple[int, int], KVFile] = {}
            for f in files:  # replicated heads (tp > KV heads): one copy of each range
                kf = KVFile.open(f)
                seen.setdefault((kf.head_lo, kf.head_hi), kf)
            return sorted(seen.values(), key=lambda f: f.head_lo)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise

    def export_tensors(self, session_id: str, lo: int, hi: int) -> list[tuple[int, int, torch.Tensor]]:
        """export_kv read into memory: [(head_lo, head_hi, [layers, 2, heads, tokens, head_dim])]."""
        files = self.export_kv(session_id, lo, hi)
        try:
            return [(f.head_lo, f.head_hi, f.read().clone()) for f in files]
        finally:
            shutil.rmtree(Path(files[0].path).parent, ignore_errors=True) if files else None

    # ---- one step: what vLLM sent since the last ------------------------------------------------
    def step(self) -> list[TokenEvent]:
        if not self.server.alive:
            raise VllmEngineDead(f"the vLLM server exited ({self.server.returncode}): {self.server.log_tail(600)}")
        try:
            batch = [self._arrivals.get(timeout=STEP_WAIT_S)]
        except queue.Empty:
            return []
        while True:
            try:
                batch.append(self._arrivals.get_nowait())
            except queue.Empty:
                break
        events: list[TokenEvent] = []
        for a in batch:
            s = self.sessions.get(a.session_id)
            req = self._requests.get(a.session_id)
            if s is None or s.is_finished or req is None or req.generation != a.generation:
                continue
            if a.token_ids:
                self._settle(a.session_id, a.generation)
            if s.status == SessionStatus.PAUSED:
                req.held.append(a)
                continue
            events += self._apply(s, a)
        if events:
            self.num_steps += 1
        return events

    def _apply(self, s: SessionState, a: Arrival) -> list[TokenEvent]:
        events = []
        if s.status == SessionStatus.WAITING:
            s.status = SessionStatus.RUNNING
        for i, tok in enumerate(a.token_ids):
            if a.records is not None and i < len(a.records) and s.sampling.logprobs is not None:
                s.logprobs.append(a.records[i])
            ev = self._append(s, tok)
            events.append(ev)
            if ev.finished:
                return events
        if a.error is not None:
            self._finish(s, "abort")
            events.append(TokenEvent(s.session_id, -1, True, "abort"))
        elif a.finish_reason is not None and not s.is_finished:
            # vLLM ended it for a reason of its own (context length): it ends here too
            self._finish(s, "length" if a.finish_reason == "length" else a.finish_reason)
            if events:
                events[-1] = TokenEvent(s.session_id, events[-1].token_id, True, s.finish_reason)
        return events

    def _append(self, s: SessionState, tok: int) -> TokenEvent:
        s.output_token_ids.append(tok)
        s.num_computed = s.num_tokens - 1
        self.tokens_generated += 1
        reason = finish_reason_after(s, tok, self.tokenizer)
        if reason is not None:
            self._finish(s, reason)
        return TokenEvent(s.session_id, tok, reason is not None, reason)

    def _finish(self, s: SessionState, reason: str, status: SessionStatus = SessionStatus.FINISHED) -> None:
        s.status = status
        s.finish_reason = reason if status == SessionStatus.FINISHED else s.finish_reason
        self._cancel(s.session_id)
        self._unstage(self._loads.pop(s.session_id, None))
        done = [k for k, v in self.sessions.items() if v.is_finished]
        for k in done[: max(0, len(done) - self.max_finished)]:
            del self.sessions[k]
            self.recomputed.pop(k, None)

    # ---- vLLM requests -------------------------------------------------------------------------
    def _submit(self, s: SessionState, load: dict | None = None) -> None:
        """A vLLM request continuing `s` from its tokens so far (with its KV loaded when `load`)."""
        p = s.sampling
        if load:
            load = {**load, "id": f"l-{uuid.uuid4().hex}"}
        params = self.exchange.transfer_params(s.session_id, load)
        body = {"model": self.model_ref, "prompt": s.all_token_ids, "stream": True, "return_token_ids": True,
                "max_tokens": p.max_tokens - len(s.output_token_ids), "temperature": p.temperature,
                "top_p": p.top_p, "top_k": p.top_k if p.top_k > 0 else -1,
                # relayout ends sessions itself, by the builtin engine's rules (EOS, stop ids and strings)
                "ignore_eos": True, "skip_special_tokens": False, "kv_transfer_params": params}
        if p.seed is not None:
            body["seed"] = p.seed
        if p.logprobs is not None:
            body["logprobs"] = p.logprobs
            body["return_tokens_as_token_ids"] = True
        old = self._requests.get(s.session_id)
        req = _Request((old.generation + 1) if old else 0)
        self._cancel(s.session_id)
        self._requests[s.session_id] = req
        if load:
            self._staged[s.session_id] = (req.generation, load)
        req.task = self._on_loop(stream_completion(self._client, s.session_id, req.generation, body, self._arrivals.put))

    def _cancel(self, session_id: str) -> None:
        """End the session's vLLM request: closing its stream aborts it in vLLM."""
        req = self._requests.pop(session_id, None)
        if req is not None and req.task is not None:
            req.task.cancel()
        staged = self._staged.pop(session_id, None)
        if staged is not None:  # its request ended before it produced a token: the load is not needed now
            self._unstage(staged[1])

    # ---- what the replica reports ----------------------------------------------------------------
    def expert_stats(self) -> dict:
        """vLLM does not report expert routing per request; zeros keep the replica API's shape."""
        L, E, w = self.cfg.num_layers, self.cfg.num_experts, self.layout.world_size
        return {"expert_counts": [[0] * E for _ in range(L)], "a2a_bytes": [[0] * w for _ in range(w)],
                "exposed_s": [0.0] * L, "total_s": [0.0] * L}

    def kv_blocks_used(self) -> int:
        return 0

    def shutdown(self) -> None:
        for sid in list(self._requests):
            self._cancel(sid)
        try:
            self._on_loop(self._client.aclose()).result(5)
        except Exception:  # noqa: BLE001 - closing on the way out
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.server.stop()
        if not self.attached:  # an attached vLLM's exchange is the user's (their vLLM still uses it)
            self.exchange.remove()
