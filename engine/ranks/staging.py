"""KV export/import through reusable host staging buffers, off the compute stream.

On CUDA a snapshot must not stop decoding while its bytes cross PCIe. `KVStager` does:

- export (device → host): at the step boundary it records an event E on the compute stream
  (every KV write of the steps so far is before E), makes its own *copy stream* wait on E, and
  enqueues there, per layer, a gather of the exported tokens' slots into a device scratch
  buffer in the checkpoint's layout ([2, kv_heads, tokens, head_dim]) and an async copy into a
  pinned host buffer. A done event D is recorded after the last copy. The call returns at once:
  later decode steps run on the compute stream while the copy drains. They only write *other*
  slots (a session's KV is append-only: tokens below `tok_hi` are never rewritten), so the
  gather of the exported slots cannot race with them; slots past `tok_hi` in the same block
  may be read mid-write but are never kept. The exported blocks must stay allocated to the
  session until the handle is ready (the caller's contract: don't free a session's blocks
  with an export of it in flight).
- import (host → device): the caller's tensor is copied into a pinned buffer (a host copy),
  a side stream waits on an event of the compute stream (earlier steps that still read the
  target blocks, e.g. of the session that owned them before, finish first), the bytes go up
  and are scattered into the KV pool there, and the compute stream is made to wait on the
  side stream's done event before its next step. The host is not blocked.

Buffers come from `BufferPool`s keyed by size class (powers of two): pinned host buffers for
the transfers and device scratch for the gathers. After a warm-up no snapshot allocates.
A buffer goes back to its pool once its copy has completed and, for an export's result,
once nobody holds a view of it any more (the caller releases the handle, or simply drops the
tensor: the pool checks the storage's use count).

On the CPU the same code runs through `HostOps` (engine/ranks/stream_ops.py): streams and events are no-ops and every copy
is a host copy, so CPU tests cover the ordering and buffer logic. Tests inject their own
`StreamOps` (recording, or deferring work per stream) to check the order of enqueues and
waits, and that deferred copies still produce the cache's bytes.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from relayout.engine.ranks.stream_ops import StreamOps, ops_for

log = logging.getLogger(__name__)

MIN_CLASS = 4096  # bytes: smallest size class


def size_class(nbytes: int) -> int:
    """The pool's size class for a request: the next power of two (at least MIN_CLASS)."""
    return max(MIN_CLASS, 1 << max(0, int(nbytes) - 1).bit_length())


# ---- buffer pools ---------------------------------------------------------------------------------
def _outside_views(buf: torch.Tensor) -> int | None:
    """How many tensors other than `buf` share its storage (None: this torch cannot tell)."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None
    return int(fn(buf.untyped_storage()._cdata)) - 2  # `buf` itself and the temporary storage object


@dataclass
class _Lent:
    buf: torch.Tensor
    done: Any = None  # event after which the device no longer touches the buffer (None: nothing pending)
    released: bool = False  # the holder said it is done with it
    auto: bool = False  # also reclaim once no view of it is alive (export results)


class BufferPool:
    """Reusable byte buffers keyed by size class.

    `acquire(n)` hands out a uint8 buffer of `size_class(n)` bytes; `lend(buf, done=ev,
    auto=...)` records what must happen before it can be reused; it comes back to the free list
    once `done` has completed and it was released (or, with `auto`, once no view of it is
    alive). `allocations` counts real allocations: after warm-up it stays put.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor], ops: StreamOps, max_bytes: int, name: str,
                 check_pinned: bool = False):
        self._alloc, self.ops, self.max_bytes, self.name = alloc, ops, max_bytes, name
        self._check_pinned = check_pinned
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lent: list[_Lent] = []
        self.pooled_bytes = 0
        self.allocations = 0  # pooled allocations
        self.overflow = 0  # one-off allocations past max_bytes (not kept)
        # the pool's own buffers (by id: a tensor's == is elementwise), so a one-off one is never kept
        self._pooled: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def _reusable(self, e: _Lent) -> bool:
        if e.done is not None and not self.ops.query(e.done):
            return False
        if e.released:
            return True
        if e.auto:
            n = _outside_views(e.buf)
            return n is not None and n <= 0
        return False

    def _healthy(self, buf: torch.Tensor) -> bool:
        # a tensor sent to another process through torch.multiprocessing is moved into shared
        # memory in place: the receiver still maps it, so it must never be written again
        if buf.is_shared():
            return False
        return not self._check_pinned or buf.is_pinned()

    def _sweep(self) -> None:
        keep = []
        for e in self._lent:
            if not self._reusable(e):
                keep.append(e)
            elif self._healthy(e.buf):
                self._free.setdefault(e.buf.numel(), []).append(e.buf)
            else:
                self.pooled_bytes -= e.buf.numel()
        self._lent = keep

    def acquire(self, nbytes: int) -> torch.Tensor:
        c = size_class(nbytes)
        with self._lock:
            self._sweep()
            free = self._free.get(c)
            if free:
                return free.pop()
            if self.pooled_bytes + c > self.max_bytes:
                # full: wait for a buffer of this class whose copy is still running, if any
                for e in self._lent:
                    if e.buf.numel() == c and (e.released or e.auto) and e.done is not None:
                        self.ops.synchronize(e.done)
                        e.done = None
                        if self._reusable(e) and self._healthy(e.buf):
                            self._lent.remove(e)
                            return e.buf
                self.overflow += 1
                log.info("%s staging pool full (%d of %d bytes): a one-off %d-byte buffer", self.name,
                         self.pooled_bytes, self.max_bytes, c)
                return self._alloc(c)
            self.allocations += 1
            self.pooled_bytes += c
            buf = self._alloc(c)
            self._pooled[id(buf)] = buf
            return buf

    def lend(self, buf: torch.Tensor, done: Any = None, released: bool = False, auto: bool = False) -> _Lent:
        e = _Lent(buf, done, released, auto)
        if self._pooled.get(id(buf)) is buf:
            with self._lock:
                self._lent.append(e)
        return e

    def give_back(self, buf: torch.Tensor, done: Any = None) -> None:
        self.lend(buf, done, released=True)

    def release(self, e: _Lent) -> None:
        e.released = True

    @property
    def lent(self) -> int:
        return len(self._lent)


def _typed(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return buf.view(dtype)[:n].view(shape)


# ---- handles --------------------------------------------------------------------------------------
@dataclass
class ExportHandle:
    """An export in flight. `wait()` blocks until the bytes are on the host and returns them,
    [layers, 2, kv_heads, tokens, head_dim] — a view of a pooled buffer, valid until
    `release()` (or, if never released, for as long as any view of it is alive)."""

    stager: KVStager
    tensor: torch.Tensor
    done: Any
    _lease: _Lent = field(repr=False)

    def ready(self) -> bool:
        return self.stager.ops.query(self.done)

    def wait(self) -> torch.Tensor:
        self.stager.ops.synchronize(self.done)
        return self.tensor

    def release(self) -> None:
        """The caller is done with `tensor` (and every view of it): the buffer may be reused."""
        self.tensor = None  # type: ignore[assignment]
        self.stager.host_pool.release(self._lease)


@dataclass
class ImportHandle:
    """An import in flight: the compute stream already waits on `done` before its next step;
    `wait()` is only for code that reads the KV pool from the host."""

    stager: KVStager
    done: Any

    def ready(self) -> bool:
        return self.stager.ops.query(self.done)

    def wait(self) -> None:
        self.stager.ops.synchronize(self.done)


# ---- the stager -----------------------------------------------------------------------------------
CHUNK_BYTES = 16 << 20  # one async copy moves at most this much, so a step's own small copies can slip in


def _chunked_copy(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int) -> None:
    """dst.copy_(src) (both contiguous, same shape and dtype) as async copies of <= chunk_bytes."""
    d, s = dst.view(-1), src.view(-1)
    step = max(1, chunk_bytes // max(1, d.element_size()))
    for a in range(0, d.numel(), step):
        d[a:a + step].copy_(s[a:a + step], non_blocking=True)


def token_slots(blocks: list[int], tok_lo: int, tok_hi: int, block_size: int) -> torch.Tensor:
    """Flat KV-pool slot of every token in [tok_lo, tok_hi) of a session with these blocks."""
    pos = torch.arange(tok_lo, tok_hi)
    blk = torch.tensor(blocks, dtype=torch.long)[pos // block_size]
    return blk * block_size + pos % block_size


def kv_geometry(kv) -> tuple[int, int, int, int, torch.dtype]:
    """(layers, block_size, kv_heads, head_dim, dtype) of a KVCache, from its tensors."""
    k0 = kv.k[0]
    return len(kv.k), k0.shape[1], k0.shape[2], k0.shape[3], k0.dtype


class KVStager:
    """Device↔host KV copies for one rank's KV cache; see the module docstring.

    `max_bytes` caps what the host pool keeps (the device scratch pool holds one layer of the
    largest transfer per class, bounded by the same figure); a transfer that does not fit is
    still done, in a one-off buffer, and counted in `overflow`."""

    def __init__(self, device: torch.device | str, max_bytes: int = 1 << 30, ops: StreamOps | None = None,
                 chunk_bytes: int = CHUNK_BYTES):
        self.device = torch.device(device)
        self.chunk_bytes = max(1, chunk_bytes)
        self.ops = ops or ops_for(self.device)
        pinned = self.ops.pinned
        self.host_pool = BufferPool(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pinned), self.ops,
                                    max_bytes, "host", check_pinned=pinned)
        self.dev_pool = BufferPool(lambda n: torch.empty(n, dtype=torch.uint8, device=self.device), self.ops,
                                   max_bytes, "device")
        self.copy_stream = self.ops.new_stream()  # device → host
        self.side_stream = self.ops.new_stream()  # host → device

    @property
    def allocations(self) -> int:
        return self.host_pool.allocations + self.dev_pool.allocations

    # ---- device → host ----
    def export(self, kv, blocks: list[int], tok_lo: int, tok_hi: int) -> ExportHandle:
        """Start copying tokens [tok_lo, tok_hi) of every layer to the host; returns at once.
        Call at a step boundary (after the step that wrote `tok_hi - 1` was enqueued)."""
        L, bs, H, D, dtype = kv_geometry(kv)
        n = tok_hi - tok_lo
        if n <= 0:
            raise ValueError(f"empty token range [{tok_lo}, {tok_hi})")
        es = torch.empty((), dtype=dtype).element_size()
        layer_bytes = 2 * H * n * D * es
        host_buf = self.host_pool.acquire(L * layer_bytes)
        host = _typed(host_buf, dtype, (L, 2, H, n, D))
        slots = token_slots(blocks, tok_lo, tok_hi, bs)
        gath_buf = self.dev_pool.acquire(n * H * D * es)
        tr_buf = self.dev_pool.acquire(layer_bytes)
        ops, cs = self.ops, self.copy_stream
        boundary = ops.new_event()
        ops.record(boundary, ops.compute_stream())  # every KV write so far is before this
        ops.wait(cs, boundary)

        def work() -> None:
            idx = slots.to(self.device, non_blocking=True)
            g = _typed(gath_buf, dtype, (n, H, D))
            tr = _typed(tr_buf, dtype, (2, H, n, D))
            for layer in range(L):
                for j, pool in enumerate((kv.k[layer], kv.v[layer])):
                    torch.index_select(pool.view(-1, H, D), 0, idx, out=g)
                    tr[j].copy_(g.transpose(0, 1))
                _chunked_copy(host[layer], tr, self.chunk_bytes)

        ops.used_on(gath_buf, cs)
        ops.used_on(tr_buf, cs)
        ops.launch(cs, work)
        done = ops.new_event()
        ops.record(done, cs)
        self.dev_pool.give_back(gath_buf, done)
        self.dev_pool.give_back(tr_buf, done)
        lease = self.host_pool.lend(host_buf, done, auto=True)
        return ExportHandle(self, host, done, lease)

    # ---- host → device ----
    def import_(self, kv, blocks: list[int], tok_lo: int, host_kv: torch.Tensor) -> ImportHandle:
        """Write `host_kv` ([layers, 2, kv_heads, tokens, head_dim], this rank's heads) into the
        session's slots from `tok_lo` on. Returns at once; the compute stream waits for it."""
        L, bs, H, D, dtype = kv_geometry(kv)
        if host_kv.dim() != 5 or host_kv.shape[0] != L or host_kv.shape[1] != 2 or host_kv.shape[2] != H \
                or host_kv.shape[4] != D:
            raise ValueError(f"KV of shape {tuple(host_kv.shape)} does not fit [{L}, 2, {H}, tokens, {D}]")
        n = host_kv.shape[3]
        if n == 0:
            return self._done_handle()
        es = torch.empty((), dtype=dtype).element_size()
        layer_bytes = 2 * H * n * D * es
        host_buf = self.host_pool.acquire(L * layer_bytes)
        host = _typed(host_buf, dtype, (L, 2, H, n, D))
        host.copy_(host_kv)  # a host copy (and the dtype cast, if any) into the staging buffer
        slots = token_slots(blocks, tok_lo, tok_lo + n, bs)
        up_buf = self.dev_pool.acquire(layer_bytes)
        ops, ss = self.ops, self.side_stream
        boundary = ops.new_event()
        compute = ops.compute_stream()
        ops.record(boundary, compute)  # steps enqueued so far may still read these blocks
        ops.wait(ss, boundary)

        def work() -> None:
            idx = slots.to(self.device, non_blocking=True)
            up = _typed(up_buf, dtype, (2, H, n, D))
            for layer in range(L):
                _chunked_copy(up, host[layer], self.chunk_bytes)
                for j, pool in enumerate((kv.k[layer], kv.v[layer])):
                    pool.view(-1, H, D).index_copy_(0, idx, up[j].transpose(0, 1))

        ops.used_on(up_buf, ss)
        ops.launch(ss, work)
        done = ops.new_event()
        ops.record(done, ss)
        ops.wait(compute, done)  # the next step sees the imported KV
        self.dev_pool.give_back(up_buf, done)
        self.host_pool.give_back(host_buf, done)
        return ImportHandle(self, done)

    def _done_handle(self) -> ImportHandle:
        ev = self.ops.new_event()
        self.ops.record(ev, self.ops.compute_stream())
        return ImportHandle(self, ev)

    def synchronize(self) -> None:
        """Block until every transfer enqueued so far has completed."""
        for s in (self.copy_stream, self.side_stream):
            ev = self.ops.new_event()
            self.ops.record(ev, s)
            self.ops.synchronize(ev)
