"""The worker side of relayout's vLLM connector (engine.vllm.connector): one TP rank's view of vLLM's
paged KV cache, and the copies in and out of it. Exports and loads run on worker threads, off the
forward path: on CUDA one layer at a time on a side stream (ordered after the step's compute by an
event) into pinned host memory; on the CPU straight into host memory. Every staged file is checked
(name, hash, shape, dtype) before a byte of it enters the cache, and a failed load is reported as
blocks for vLLM to recompute, never raised into its step."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from relayout.engine.vllm.exchange import NAME_RE, Exchange, ExchangeError, read_kv, write_error, write_kv
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("relayout.vllm_connector")


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


def open_side(vllm_config: VllmConfig, extra: dict, kv_cache_config: Any) -> tuple[Exchange, KVGeometry | None, int]:
    """What both sides of the connector start from: the exchange, vLLM's KV geometry and its block size."""
    geometry = KVGeometry.from_vllm(kv_cache_config, num_layers(vllm_config)) if kv_cache_config is not None else None
    block_size = geometry.block_size if geometry else vllm_config.cache_config.block_size
    return Exchange.open(extra["exchange"]), geometry, block_size


def num_layers(vllm_config: VllmConfig) -> int | None:
    n = getattr(vllm_config.model_config.hf_text_config, "num_hidden_layers", None)
    return int(n) if n is not None else None


class WorkerSide:
    """One TP rank: each layer's cache as (K, V) views [blocks, local KV heads, block_size, head_dim]."""

    def __init__(self, vllm_config: VllmConfig, extra: dict, kv_cache_config: Any = None):
        self.exchange, self.geometry, self.block_size = open_side(vllm_config, extra, kv_cache_config)
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
            self._load_job(spec)  # before this step's forward reads the request's KV

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
            with self._errors:  # reported in this step's output: vLLM recomputes those blocks
                self.load_errors.update(spec.block_ids[spec.tok_lo // bs: -(-spec.tok_hi // bs)])
            self._say_failed(spec.load_id, f"{type(e).__name__}: {e}")

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
