"""relayout's KV connector for stock vLLM, loaded through `--kv-transfer-config`
(`kv_connector_module_path`): it moves a running request's KV out of vLLM's paged cache and a
moved session's KV into it, per TP rank's KV heads, as engine.vllm_exchange files.

One class a side, as vLLM's own connectors: `SchedulerSide` (in the engine core) knows each
relayout session's request and its blocks, answers the replica's commands on a Unix socket and
puts them into the step's metadata; `WorkerSide` (one per TP rank) copies between the cache and
the files at the start of that step, before the forward writes anything. Full positions of a
request's KV never change, so an export at a step boundary is consistent without pausing vLLM.

What production does to a moved request, and what this connector does then:
- Only `kv_transfer_params` signed with the replica's per-launch secret count (engine.vllm_exchange):
  any client of vLLM's port can send them, and an unsigned or replayed one is a plain request.
- Copies are off the forward path: an export's step records where its compute ends and a worker
  thread copies the blocks (on a side CUDA stream into pinned host memory) and writes the file; the
  request's blocks are freed only once every worker reports it (`get_finished`). A load is
  asynchronous: the request waits in vLLM's WAITING_FOR_REMOTE_KVS while a worker thread reads,
  checks and copies its KV, and `get_finished` releases it. The connector reports every imported
  token but the request's last, which vLLM computes to produce the next one.
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from relayout.engine.vllm_exchange import NAME_RE, Exchange, ExchangeError, read_kv, write_error, write_kv
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
class ExportSpec:
    out_dir: str
    block_ids: list[int]
    tok_lo: int
    tok_hi: int
    req_id: str = ""


@dataclass
class LoadSpec:
    load_id: str
    files: list[dict]  # {name, tok_lo, tok_hi, hash}, each a file directly in the exchange
    block_ids: list[int]
    tok_lo: int
    tok_hi: int
    req_id: str = ""


@dataclass
class RelayoutMetadata(KVConnectorMetadata):
    exports: list[ExportSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # requests whose blocks this step may overwrite


@dataclass
class _Command:
    msg: dict
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict | None = None


@dataclass(frozen=True)
class KVGeometry:
    """What vLLM's `kv_cache_config` says the cache is: the main model's attention layers in model
    order (never a drafter's), its block size and dtype."""

    layer_names: tuple[str, ...]
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_vllm(cls, kv_cache_config: Any, num_layers: int | None) -> KVGeometry:
        from vllm.model_executor.models.utils import extract_layer_index

        groups = [g for g in kv_cache_config.kv_cache_groups
                  if not getattr(g, "is_eagle_group", False) and getattr(g, "enable_kv_transfer", True)]
        if len(groups) != 1:
            raise RuntimeError(f"relayout's vLLM connector moves one full-attention KV cache group; vLLM made "
                               f"{len(groups)} (run vLLM with --disable-hybrid-kv-cache-manager)")
        spec = groups[0].kv_cache_spec
        names = tuple(sorted(groups[0].layer_names, key=extract_layer_index))
        if num_layers is not None and len(names) != num_layers:
            raise RuntimeError(f"vLLM's KV cache group holds {len(names)} layers, the model {num_layers}: "
                               "a drafter's layers would be mixed in")
        return cls(names, int(spec.block_size), spec.dtype)


def copy_blocks_out(views: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], block_size: int,
                    tok_lo: int, tok_hi: int, stream: Any = None, after: Any = None) -> torch.Tensor:
    """Tokens [tok_lo, tok_hi) of every layer's (K, V) block views [blocks, H, bs, D] as a host tensor
    [layers, 2, H, tokens, D]: one layer's blocks gathered at a time (never the whole request on the
    device), into a pinned host buffer on `stream` after the event `after` on CUDA; on the CPU the
    blocks go straight into the buffer. Runs on any thread."""
    first, last = tok_lo // block_size, -(-tok_hi // block_size)
    k0 = views[0][0]
    nb, heads, dim = last - first, k0.shape[1], k0.shape[-1]
    cuda = k0.device.type == "cuda"
    host = torch.empty((len(views), 2, nb, heads, block_size, dim), dtype=k0.dtype, pin_memory=cuda)
    idx = torch.tensor(block_ids[first:last], dtype=torch.long, device=k0.device)
    if cuda:
        with torch.cuda.stream(stream):
            stream.wait_event(after)
            for layer, (k, v) in enumerate(views):
                host[layer, 0].copy_(k.index_select(0, idx), non_blocking=True)
                host[layer, 1].copy_(v.index_select(0, idx), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
    else:
        for layer, (k, v) in enumerate(views):
            torch.index_select(k, 0, idx, out=host[layer, 0])
            torch.index_select(v, 0, idx, out=host[layer, 1])
    off = tok_lo - first * block_size
    return host.permute(0, 1, 3, 2, 4, 5).reshape(len(views), 2, heads, nb * block_size, dim)[
        :, :, :, off: off + tok_hi - tok_lo]


def _num_layers(vllm_config: VllmConfig) -> int | None:
    n = getattr(vllm_config.model_config.hf_text_config, "num_hidden_layers", None)
    return int(n) if n is not None else None


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, extra: dict, kv_cache_config: Any = None):
        self.exchange = Exchange.open(extra["exchange"])
        self.geometry = (KVGeometry.from_vllm(kv_cache_config, _num_layers(vllm_config))
                         if kv_cache_config is not None else None)
        self.block_size = self.geometry.block_size if self.geometry else vllm_config.cache_config.block_size
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
        # never the last token: vLLM computes it to sample the next. Asynchronous: the request waits in
        # vLLM's WAITING_FOR_REMOTE_KVS while a worker thread reads and copies its KV, off every step
        n = min(int(load["tokens"]), request.num_tokens - 1)
        return max(0, n - num_computed_tokens), True

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


class WorkerSide:
    """One TP rank: each layer's cache as (K, V) views [blocks, local KV heads, block_size, head_dim]."""

    def __init__(self, vllm_config: VllmConfig, extra: dict, kv_cache_config: Any = None):
        self.exchange = Exchange.open(extra["exchange"])
        self.geometry = (KVGeometry.from_vllm(kv_cache_config, _num_layers(vllm_config))
                         if kv_cache_config is not None else None)
        self.block_size = self.geometry.block_size if self.geometry else vllm_config.cache_config.block_size
        self.num_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self.cpu = vllm_config.device_config.device_type == "cpu"
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rank, self.head_lo, self.head_hi = 0, 0, 0
        self.load_errors: set[int] = set()
        self.io = ThreadPoolExecutor(1, thread_name_prefix="relayout-kv-io")  # exports' copies and files, in order
        self.stream: Any = None  # a side CUDA stream for copies (None on the CPU)
        self.in_flight: dict[str, list[Future]] = {}  # request -> its exports not yet known done
        self.exported: set[str] = set()  # requests exported from (the scheduler holds their blocks at the end)
        self.ended: set[str] = set()  # of those, the ones vLLM finished: reported once their copies are done
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="relayout-kv-load")  # loads beside exports
        self.loading: dict[str, Future] = {}  # request -> its load, until reported finished receiving
        self._errors = threading.Lock()

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
        if self.geometry is None:
            raise RuntimeError("relayout's vLLM connector needs vLLM's kv_cache_config (vLLM >= 0.11)")
        missing = [n for n in self.geometry.layer_names if n not in kv_caches]
        if missing:
            raise RuntimeError(f"vLLM registered no KV cache for layers {missing[:3]}")
        self.views = [self._views(kv_caches[n]) for n in self.geometry.layer_names]
        dev = self.views[0][0].device
        if dev.type == "cuda":
            self.stream = torch.cuda.Stream(dev)

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

    def export(self, spec: ExportSpec) -> Future:
        """Copy tokens [tok_lo, tok_hi) of a request out to `rank{r}.safetensors` off the forward path:
        the step only records where its compute ends; the I/O thread gathers one layer at a time on a
        side CUDA stream ordered after that event into a pinned host buffer (on the CPU, straight into
        it), then writes the file. Positions below tok_hi never change while the request runs, and its
        blocks outlive it until the copy is done (request_finished delays their free; a preemption
        waits in handle_preemptions)."""
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record()  # the current stream: after what this step computes
        fut = self.io.submit(self._copy_out, spec, event)
        self.in_flight.setdefault(spec.req_id, []).append(fut)
        self.exported.add(spec.req_id)
        return fut

    def _copy_out(self, spec: ExportSpec, step_done: Any) -> None:
        path = Path(spec.out_dir) / f"rank{self.rank}.safetensors"
        try:
            kv = copy_blocks_out(self.views, spec.block_ids, self.block_size, spec.tok_lo, spec.tok_hi,
                                 self.stream, step_done)
            write_kv(path, kv, self.head_lo, self.head_hi, spec.tok_lo, spec.tok_hi)
        except Exception as e:  # noqa: BLE001 - the replica reads why; vLLM's step never sees it
            log.exception("relayout: export of %s failed", spec.out_dir)
            write_error(path, f"{type(e).__name__}: {e}")

    def wait_exports(self, req_ids: list[str]) -> None:
        """Before blocks of these requests are overwritten (preempted): their copies finish first."""
        for rid in req_ids:
            for fut in self.in_flight.pop(rid, []):
                fut.result()

    def finished_sending(self, finished_req_ids: set[str]) -> set[str] | None:
        """Requests that ended whose blocks vLLM kept for our copies (request_finished said so), now free."""
        self.ended |= finished_req_ids & self.exported
        done = {rid for rid in self.ended if all(f.done() for f in self.in_flight.get(rid, []))}
        for rid in done:
            self.ended.discard(rid)
            self.exported.discard(rid)
            self.in_flight.pop(rid, None)
        for rid in [r for r, fs in self.in_flight.items() if fs and all(f.done() for f in fs)]:
            if rid not in self.ended:
                del self.in_flight[rid]  # a running request's copies are done: nothing to wait for
        return done or None

    def _read(self, f: dict, lo: int, hi: int) -> torch.Tensor:
        """This rank's heads of tokens [lo, hi) of one staged file, every property checked first."""
        kv, meta = read_kv(self.exchange.path(str(f.get("name"))), f.get("hash"))
        k_lo, k_hi = int(meta.get("tok_lo", -1)), int(meta.get("tok_hi", -1))
        h_lo, h_hi = int(meta.get("head_lo", -1)), int(meta.get("head_hi", -1))
        want = (len(self.views), 2, h_hi - h_lo, k_hi - k_lo, self.views[0][0].shape[-1])
        if (k_lo, k_hi) != (int(f["tok_lo"]), int(f["tok_hi"])) or not (h_lo <= self.head_lo < self.head_hi <= h_hi):
            raise ExchangeError(f"staged file {f.get('name')} holds tokens [{k_lo}, {k_hi}) and heads "
                                f"[{h_lo}, {h_hi}), not what its load names")
        if tuple(kv.shape) != want:
            raise ExchangeError(f"staged file {f.get('name')} has shape {list(kv.shape)}, this cache takes "
                                f"{list(want)}")
        cache_dtype = self.views[0][0].dtype
        if kv.dtype != cache_dtype:  # never cast silently: another dtype means other numbers
            raise ExchangeError(f"staged file {f.get('name')} holds {kv.dtype} KV, this cache is {cache_dtype}")
        return kv[:, :, self.head_lo - h_lo: self.head_hi - h_lo, lo - k_lo: hi - k_lo]

    def load(self, spec: LoadSpec) -> None:
        parts = []
        for f in spec.files:  # every file read and checked before a byte enters the cache
            lo, hi = max(spec.tok_lo, int(f["tok_lo"])), min(spec.tok_hi, int(f["tok_hi"]))
            if lo < hi:
                parts.append((lo, hi, self._read(f, lo, hi)))
        covered = sum(hi - lo for lo, hi, _ in parts)
        if covered != spec.tok_hi - spec.tok_lo:
            raise ExchangeError(f"the staged files cover {covered} of the {spec.tok_hi - spec.tok_lo} tokens to load")
        for lo, hi, kv in parts:
            b, o = self._index(spec.block_ids, lo, hi)
            for layer, (k, v) in enumerate(self.views):
                k[b, :, o] = kv[layer, 0].transpose(0, 1).to(k.device)
                v[b, :, o] = kv[layer, 1].transpose(0, 1).to(v.device)

    def start_step(self, meta: RelayoutMetadata) -> None:
        for spec in meta.exports:
            self.export(spec)
        for spec in meta.loads:
            self.loading[spec.req_id] = self.loader.submit(self._load_job, spec)

    def _load_job(self, spec: LoadSpec) -> None:
        try:
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    self.load(spec)
                self.stream.synchronize()
            else:
                self.load(spec)
        except Exception as e:  # noqa: BLE001 - never into vLLM's step: its blocks are recomputed
            log.warning("relayout: load %s failed, vLLM recomputes it: %s", spec.load_id, e)
            bs = self.block_size
            with self._errors:  # reported no later than the request's finished_recving (get_finished first)
                self.load_errors.update(spec.block_ids[spec.tok_lo // bs: -(-spec.tok_hi // bs)])
            self._say_failed(spec.load_id, f"{type(e).__name__}: {e}")

    def finished_recving(self) -> set[str] | None:
        done = {rid for rid, fut in self.loading.items() if fut.done()}
        for rid in done:
            del self.loading[rid]
        return done or None

    def _say_failed(self, load_id: str, why: str) -> None:
        name = f"{load_id}.failed"
        if NAME_RE.fullmatch(name):
            try:
                (self.exchange.dir / name).write_text(why[:2000])
            except OSError:
                pass  # the replica still sees the recompute in vLLM's own metrics

    def take_load_errors(self) -> set[int]:
        with self._errors:
            out, self.load_errors = self.load_errors, set()
        return out


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
        return self.worker.finished_sending(finished_req_ids), self.worker.finished_recving()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
