"""relayout's KV connector for stock vLLM, loaded through `--kv-transfer-config`
(`kv_connector_module_path`): it moves a running request's KV out of vLLM's paged cache and a
moved session's KV into it, per TP rank's KV heads, as engine.vllm_exchange files.

One class a side, as vLLM's own connectors: `SchedulerSide` (in the engine core) knows each
relayout session's request and its blocks, answers the replica's commands on a Unix socket and
puts them into the step's metadata; `WorkerSide` (one per TP rank) copies between the cache and
the files at the start of that step, before the forward writes anything. Full positions of a
request's KV never change, so an export at a step boundary is consistent without pausing vLLM.

Loads are synchronous: the connector reports every imported token but the request's last, which
vLLM computes to produce the next one (a sync load must leave it one), so a moved request recomputes
one token."""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from relayout.engine.vllm_exchange import LOAD_KEY, SESSION_KEY, KVFile, write_error, write_kv
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("relayout.vllm_connector")
COMMAND_TIMEOUT_S = 30.0  # a command waits this long for the engine's next step
COMMAND_POLL_S = 0.05  # how often a waiting command looks whether its request ended
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class ExportSpec:
    out_dir: str
    block_ids: list[int]
    tok_lo: int
    tok_hi: int


@dataclass
class LoadSpec:
    files: list[str]
    block_ids: list[int]
    tok_lo: int
    tok_hi: int


@dataclass
class RelayoutMetadata(KVConnectorMetadata):
    exports: list[ExportSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class _Command:
    msg: dict
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict | None = None


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, extra: dict):
        self.block_size = vllm_config.cache_config.block_size
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.sessions: dict[str, Request] = {}
        self.commands: queue.Queue[_Command] = queue.Queue()
        self._answering = threading.Lock()  # a command is answered once: by a step, or by its waiting caller
        self.loads: dict[str, LoadSpec] = {}  # request id -> KV to load in its first step
        self.kv_cache_manager = None
        sock = extra.get("control_socket")
        if sock:
            self._serve(sock)

    # ---- the replica's commands (a thread of their own) ------------------------------------------
    def _serve(self, path: str) -> None:
        side = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    msg = json.loads(self.rfile.readline())
                    answer = side.command(msg)
                except Exception as e:  # noqa: BLE001 - every failure goes back to the caller
                    answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                self.wfile.write(json.dumps(answer).encode() + b"\n")

        if os.path.exists(path):
            os.unlink(path)
        server = socketserver.ThreadingUnixStreamServer(path, Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="relayout-control", daemon=True).start()

    def command(self, msg: dict) -> dict:
        if msg.get("op") == "ping":
            return {"ok": True, "ranks": self.tp, "block_size": self.block_size}
        if msg.get("op") != "export":
            return {"ok": False, "error": f"unknown command {msg.get('op')!r}"}
        cmd = _Command(msg)
        self.commands.put(cmd)
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not cmd.done.wait(COMMAND_POLL_S):
            req = self.sessions.get(str(msg.get("session")))
            if req is None or req.is_finished():
                # vLLM may idle now, and no step would come to answer (an export waited 30 s when its
                # session ended at the cut): answered here, as a step would ("no running request")
                self._answer(cmd, lambda: self._export(msg))
            elif time.monotonic() > deadline:
                self._answer(cmd, lambda: ({"ok": False, "error": f"session {msg.get('session')} is not running "
                                                                  "in vLLM (no step came)"}, None))
        return cmd.answer or {"ok": False, "error": "no answer"}

    def _answer(self, cmd: _Command, answer: Callable[[], tuple[dict, ExportSpec | None]]) -> ExportSpec | None:
        """Answer `cmd` unless it was answered already (by a step, or by its waiting caller): once."""
        with self._answering:
            if cmd.done.is_set():
                return None
            try:
                cmd.answer, spec = answer()
            except Exception as e:  # noqa: BLE001 - said to the caller, never into vLLM's loop
                cmd.answer, spec = {"ok": False, "error": f"{type(e).__name__}: {e}"}, None
            cmd.done.set()
            return spec

    def _export(self, msg: dict) -> tuple[dict, ExportSpec | None]:
        sid = msg["session"]
        req = self.sessions.get(sid)
        if req is None or req.is_finished():
            return {"ok": False, "error": f"session {sid} has no running request in vLLM", "finished": True}, None
        from vllm.v1.request import RequestStatus

        if req.status != RequestStatus.RUNNING:
            return {"ok": False, "error": f"session {sid}'s vLLM request is {req.status.name}, not running"}, None
        hi = min(int(msg["hi"]), req.num_computed_tokens)  # computed before this step: in the cache now
        lo = int(msg["lo"])
        if hi <= lo:
            return {"ok": True, "ranks": 0, "tok_hi": max(lo, hi)}, None
        blocks = list(self.kv_cache_manager.get_block_ids(req.request_id)[0])[: -(-hi // self.block_size)]
        return {"ok": True, "ranks": self.tp, "tok_hi": hi}, ExportSpec(msg["dir"], blocks, lo, hi)

    # ---- vLLM's scheduler hooks --------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        sid = (request.kv_transfer_params or {}).get(SESSION_KEY)
        if sid:
            self.sessions[sid] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        load = (request.kv_transfer_params or {}).get(LOAD_KEY)
        if not load:
            return 0, False
        # never the last token: vLLM computes it to sample the next (a sync load must leave one to compute)
        n = min(int(load["tokens"]), request.num_tokens - 1)
        return max(0, n - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        load = (request.kv_transfer_params or {}).get(LOAD_KEY)
        if num_external_tokens <= 0 or not load:
            return
        hi = min(int(load["tokens"]), request.num_tokens - 1)
        self.loads[request.request_id] = LoadSpec(list(load["files"]), list(blocks.get_block_ids()[0]),
                                                  hi - num_external_tokens, hi)

    def build_connector_meta(self, scheduler_output: Any) -> RelayoutMetadata:
        meta = RelayoutMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            spec = self.loads.pop(new.req_id, None)
            if spec is not None:
                spec.block_ids = list(new.block_ids[0])  # every block the request holds now
                meta.loads.append(spec)
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            if (spec := self._answer(cmd, lambda c=cmd: self._export(c.msg))) is not None:
                meta.exports.append(spec)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.loads.pop(request.request_id, None)
        sid = (request.kv_transfer_params or {}).get(SESSION_KEY)
        if sid and self.sessions.get(sid) is request:
            del self.sessions[sid]
        return False, None


class WorkerSide:
    """One TP rank: each layer's cache as (K, V) views [blocks, local KV heads, block_size, head_dim]."""

    def __init__(self, vllm_config: VllmConfig):
        self.block_size = vllm_config.cache_config.block_size
        self.num_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self.cpu = vllm_config.device_config.device_type == "cpu"
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rank, self.head_lo, self.head_hi = 0, 0, 0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        K = self.num_kv_heads
        if tp <= K:
            self.head_lo, self.head_hi = self.rank * (K // tp), (self.rank + 1) * (K // tp)
        else:  # replicated: each rank holds one head
            h = self.rank // (tp // K)
            self.head_lo, self.head_hi = h, h + 1
        named = sorted(kv_caches.items(), key=lambda kv: int(m.group(1)) if (m := _LAYER_RE.search(kv[0])) else 0)
        self.views = [self._views(t) for _, t in named]

    def _views(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.block_size
        if t.dim() == 4 and t.shape[2] == bs and self.cpu:
            # CPU attention ("vec" kernels): per (block, head) a [bs*2*D] buffer holding K transposed
            # ([D, bs]) then V ([bs, D]) (csrc/cpu/cpu_attn_vec.hpp)
            nb, h, _, d2 = t.shape
            d = d2 // 2
            f = t.view(nb, h, 2, bs * d)
            return f[:, :, 0].view(nb, h, d, bs).transpose(2, 3), f[:, :, 1].view(nb, h, bs, d)
        if t.dim() == 4 and t.shape[2] == bs:  # [nb, H, bs, 2*D]: K then V per token and head
            d = t.shape[-1] // 2
            return t[..., :d], t[..., d:]
        if t.dim() == 5 and t.shape[0] == 2 and t.shape[2] == bs:  # [2, nb, bs, H, D] (FlashAttention)
            return t[0].permute(0, 2, 1, 3), t[1].permute(0, 2, 1, 3)
        raise RuntimeError(f"relayout's vLLM connector does not know this KV cache layout: {list(t.shape)}")

    def _index(self, block_ids: list[int], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.views[0][0].device
        pos = torch.arange(lo, hi)
        blocks = torch.tensor(block_ids, dtype=torch.long)[pos // self.block_size]
        return blocks.to(dev), (pos % self.block_size).to(dev)

    def export(self, spec: ExportSpec) -> None:
        b, o = self._index(spec.block_ids, spec.tok_lo, spec.tok_hi)
        # [n, H, D] per layer, K and V -> [layers, 2, H, n, D]
        kv = torch.stack([torch.stack([k[b, :, o], v[b, :, o]]).transpose(1, 2) for k, v in self.views]).cpu()
        write_kv(os.path.join(spec.out_dir, f"rank{self.rank}.safetensors"), kv, self.head_lo, self.head_hi,
                 spec.tok_lo, spec.tok_hi)

    def load(self, spec: LoadSpec) -> None:
        for path in spec.files:
            f = KVFile.open(path)
            lo, hi = max(spec.tok_lo, f.tok_lo), min(spec.tok_hi, f.tok_hi)
            if lo >= hi:
                continue
            kv = f.read(self.head_lo, self.head_hi)[:, :, :, lo - f.tok_lo: hi - f.tok_lo]
            b, o = self._index(spec.block_ids, lo, hi)
            for layer, (k, v) in enumerate(self.views):
                k[b, :, o] = kv[layer, 0].transpose(0, 1).to(k.device, k.dtype)
                v[b, :, o] = kv[layer, 1].transpose(0, 1).to(v.device, v.dtype)

    def start_step(self, meta: RelayoutMetadata) -> None:
        for spec in meta.exports:
            try:
                self.export(spec)
            except Exception as e:  # noqa: BLE001 - the replica reads why, the step goes on
                log.exception("relayout: export of %s failed", spec.out_dir)
                write_error(os.path.join(spec.out_dir, f"rank{self.rank}.safetensors"), f"{type(e).__name__}: {e}")
        for spec in meta.loads:
            self.load(spec)  # a failed load must fail the step: the tokens would be garbage


class RelayoutConnector(KVConnectorBase_V1):
    """What vLLM instantiates, once per role: the scheduler side or one worker side."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.scheduler = SchedulerSide(vllm_config, extra) if role == KVConnectorRole.SCHEDULER else None
        self.worker = WorkerSide(vllm_config) if role == KVConnectorRole.WORKER else None

    # scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.scheduler.request_finished(request, block_ids)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, RelayoutMetadata) and (meta.exports or meta.loads):
            self.worker.start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
