"""KV chunks: one safetensors payload (tensor "kv") run through a codec.

Callers always see a chunk as [2, heads, tokens, head_dim] (K/V, KV heads, tokens, head_dim). It is
STORED token-major, [2, tokens, heads, head_dim] (format version 2): the KV pool's own order, so the
copy between a run of pool blocks and a chunk is one contiguous memcpy. Format version 1 stored it
as [2, heads, tokens, head_dim]; readers pass the manifest's version and get the same logical view.

Chunks are content-addressed by the xxh3_128 of their STORED bytes, so identical chunks
(e.g. the unchanged prefix of a session in an incremental checkpoint) are stored once and
a corrupt chunk is caught before any decoding work is done.

Both directions touch each KV byte once: `new_kv_chunk` hands out a `KVChunk` whose tensor already
is the payload of a header-prefixed chunk buffer (an exporter fills it, `pack_kv` stores that
buffer as is), and `kv_view` reads a verified chunk in place (no copy for codec "none").
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import threading
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import torch
import xxhash
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.codecs import decode, encode, new_buffer
from relayout.storage.format.manifest import FORMAT_VERSION, ChunkRef
from relayout.storage.settings import settings
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

TENSOR_NAME = "kv"
SCALE_NAME = "kv_scale"  # fp8 KV: float32 [2, tokens, heads] (logical [2, heads, tokens]) beside "kv"
_T, _R = TypeVar("_T"), TypeVar("_R")
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_IN_POOL = threading.local()
PARALLEL_MIN_BYTES = 1 << 20
TASKS_PER_THREAD = 4  # parallel_map hands each thread about this many slices of the items


def _run_in_pool(fn: Callable[[_T], _R], xs: list[_T]) -> list[_R]:
    _IN_POOL.on = True
    return [fn(x) for x in xs]


def work_inline() -> None:
    """From now on this thread runs parallel_map's calls itself (a background thread whose work
    must stay at its own, lowered, priority rather than go to the shared pool's threads)."""
    _IN_POOL.on = True


def parallel_map(fn: Callable[[_T], _R], items: Iterable[_T], nbytes: int | None = None) -> list[_R]:
    """``[fn(x) for x in items]`` on up to torch.get_num_threads() threads, in order; the first
    exception is raised (after the calls already running end). For work that releases the GIL
    (hashing, numpy copies, store I/O): a few slices of the items per thread, no OpenMP team to wake.
    `nbytes`: the bytes the calls touch in all; below PARALLEL_MIN_BYTES they run inline (handing
    a few small copies to other threads costs more than it saves, and a caller that waits, e.g.
    the engine thread cutting a replication round, waits for those threads to be scheduled)."""
    global _POOL
    items = list(items)
    n = max(1, torch.get_num_threads())
    if n == 1 or len(items) < 2 or getattr(_IN_POOL, "on", False) or (
            nbytes is not None and nbytes < PARALLEL_MIN_BYTES):  # nested: inline, never wait on ourselves
        return [fn(x) for x in items]
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers != n:  # follows set_num_threads
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(n, thread_name_prefix="relayout-chunks")
        pool = _POOL
    # a few slices per thread: a future per 2 MiB chunk cost more hand-offs than copy on 2 cores
    k = -(-len(items) // min(len(items), n * TASKS_PER_THREAD))
    futs = [pool.submit(_run_in_pool, fn, items[i : i + k]) for i in range(0, len(items), k)]
    try:
        return [r for f in futs for r in f.result()]
    finally:
        for f in futs:
            f.cancel()
        # A failure must not return while sibling calls still run: they would go on writing
        # (temp files, pins) after the caller has cleaned up and answered.
        wait(futs)


def chunk_hash(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return found


# safetensors' dtype codes: chunks of these dtypes take the one-copy paths below (others go through
# safetensors.torch.save/load); fp8 KV is stored as its raw bytes, exactly
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


# Chunk buffers are allocated in one burst per snapshot (the whole KV being cut) and, once stored
# or sent, freed in one burst. glibc hands freed memory above 64 MiB straight back to the kernel,
# so every snapshot page-faults all of its buffers in anew: ~1 GB/s on a VM, about a tenth of a
# memcpy into memory the process already holds. keep_freed_memory lets malloc keep that much.

def keep_freed_max() -> int:  # RELAYOUT_SNAPSHOT_KEEP_MB (0: leave malloc alone); mallopt takes an int
    return min(settings().snapshot_keep_mb << 20, 2**31 - 1)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its adaptive threshold: chunks come from the heap
try:
    _mallopt = ctypes.CDLL(None).mallopt
    _mallopt.restype, _mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
except (AttributeError, OSError):  # not glibc
    _mallopt = None
_kept = 64 << 20  # glibc's default ceiling (twice its largest adaptive mmap threshold)
_kept_lock = threading.Lock()


def keep_freed_memory(nbytes: int) -> int:
    """Let this process's malloc keep up to `nbytes` (at most keep_freed_max()) of freed memory for
    reuse rather than return it to the kernel at once; never lowers an earlier setting. Process-wide
    (glibc mallopt); a no-op elsewhere. Returns the amount now kept."""
    global _kept
    # headroom: glibc gives back ALL of a free top chunk once it exceeds the threshold, and a
    # snapshot's freed buffers plus their headers (and whatever else was freed) exceed `nbytes`
    want = min(int(nbytes) + int(nbytes) // 8 + (8 << 20), keep_freed_max())
    with _kept_lock:
        if _mallopt is not None and want > _kept:
            if _mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 and _mallopt(_M_TRIM_THRESHOLD, want) == 1:
                _kept = want
        return _kept


def one_malloc_arena() -> bool:
    """Make every thread of this process allocate from malloc's main heap (glibc M_ARENA_MAX=1);
    True if set. Call it first thing in a replica or rank process, before it starts threads.

    Why: a round's chunk buffers are allocated on one thread (a link reader, a pool thread) and
    freed on another once imported or sent. Each thread allocates from an arena of its own, and
    glibc gives an arena's whole free 64 MiB heaps back to the kernel whatever M_TRIM_THRESHOLD
    says, so keep_freed_memory kept nothing there: every round page-faulted all of its buffers in
    anew (measured on this project's 2-core VM: 65,856 faults and 0.9-1.4 s more for a 256 MiB
    cold round, which took 0.3-0.5 s with the pages kept). The main heap honours the threshold. The
    cost, one lock for every thread's malloc, does not show in decode steps: big tensors are few."""
    if _mallopt is None or keep_freed_max() <= 0:
        return False
    return _mallopt(_M_ARENA_MAX, 1) == 1


_bytearray = new_buffer  # (from codecs, which decodes into such buffers too)


@functools.lru_cache(maxsize=1024)
def _st_prefix(shape: tuple[int, ...], code: str, nbytes: int) -> bytes:
    """The 8-byte length + JSON header safetensors.torch.save writes for one tensor "kv"."""
    head = json.dumps({TENSOR_NAME: {"dtype": code, "shape": list(shape), "data_offsets": [0, nbytes]}},
                      separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8-byte alignment
    return len(head).to_bytes(8, "little") + head


def _payload(buf: bytearray, offset: int, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8, offset=offset, count=nbytes).view(dtype).view(shape)


def stored_shape(shape: tuple[int, ...], format_version: int = FORMAT_VERSION) -> tuple[int, ...]:
    """The stored tensor's shape for a logical [2, heads, tokens, head_dim] chunk."""
    shape = tuple(int(s) for s in shape)
    if format_version >= 2 and len(shape) == 4:
        return (shape[0], shape[2], shape[1], shape[3])
    return shape


def _logical(stored: torch.Tensor, format_version: int) -> torch.Tensor:
    """The [2, heads, tokens, head_dim] view of a stored chunk tensor (no copy)."""
    return stored.transpose(1, 2) if format_version >= 2 else stored


@dataclass(frozen=True)
class ChunkPieces:
    """A chunk's stored bytes as the concatenation of `views` (`size` bytes in all), left where they
    lie (storage.format.pieces.in_place_chunk): a frame sink sends them as they are."""

    views: tuple[memoryview, ...]
    size: int

    def __len__(self) -> int:
        return self.size

    def joined(self) -> bytearray:
        return bytearray().join(self.views)


@dataclass(eq=False)
class KVChunk:
    """A chunk being made for a checkpoint or a round, before it is stored: `view` is its logical
    [2, heads, tokens, head_dim] KV, `buf` its stored bytes (safetensors header + payload) when they
    are already laid out — a bytearray whose payload is `view`'s memory (new_kv_chunk), or the
    pieces of a pool's own rows (ChunkPieces; `view` is then a meta tensor: shape and dtype only) —
    and `hash` those bytes' hash once taken (seal_kv_chunk, in_place_chunk). `pack_kv` then only wraps
    them. `view` must not change after the hash is taken (a reader would refuse the chunk as corrupt)."""

    view: torch.Tensor
    buf: bytearray | ChunkPieces | None = None  # None: `view` is packed the ordinary way (a copy)
    hash: str | None = None

    @property
    def stored(self) -> bool:
        """Stored with codec "none" as it is: no copy, no hashing left (a sealed or in-place chunk)."""
        return self.hash is not None


def new_kv_chunk(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> KVChunk:
    """A chunk of `shape` ([2, heads, tokens, head_dim]) whose `view` is the payload of a fresh chunk
    buffer, header already written (a token-major view: `.transpose(1, 2)` of it is contiguous). Fill
    every element of `view`, then `pack_kv` it: that buffer becomes the stored chunk as is (no second
    copy). Contents are undefined until filled."""
    shape = tuple(int(s) for s in shape)
    code = _ST_DTYPES.get(dtype)
    n = math.prod(shape) * dtype.itemsize
    if code is None or n == 0 or len(shape) != 4:
        return KVChunk(torch.empty(shape, dtype=dtype))  # packed the ordinary way
    st_shape = stored_shape(shape)
    prefix = _st_prefix(st_shape, code, n)
    buf = _bytearray(len(prefix) + n)
    buf[: len(prefix)] = prefix
    return KVChunk(_logical(_payload(buf, len(prefix), st_shape, dtype, n), FORMAT_VERSION), buf)


def kv_chunk_hasher(c: KVChunk) -> xxhash.xxh3_128 | None:
    """A streaming hash of new_kv_chunk `c`'s stored bytes, already fed its header (None if `c` has no
    buffer of its own). An exporter feeds it the payload in memory order, each piece right after
    copying it while it is still in L2 (a whole 2 MiB chunk hashed after its copy is read back from
    L3/memory: ~30% more time than the copy alone), then passes it to seal_kv_chunk."""
    if not isinstance(c.buf, bytearray):
        return None
    h = xxhash.xxh3_128()
    with memoryview(c.buf) as mv:
        h.update(mv[: len(c.buf) - c.view.numel() * c.view.element_size()])
    return h


def seal_kv_chunk(c: KVChunk, hasher: xxhash.xxh3_128 | None = None) -> None:
    """Hash a filled new_kv_chunk now, while its bytes are still in this core's cache (the exporter's
    thread, right after the copy): `pack_kv` with codec "none" then reuses that hash. `hasher`:
    kv_chunk_hasher(c), fed every payload byte as it was copied (its digest is taken instead of
    hashing the buffer again)."""
    if isinstance(c.buf, bytearray):
        c.hash = chunk_hash(c.buf) if hasher is None else hasher.hexdigest()


def _st_bytes(t: torch.Tensor) -> bytes:
    """safetensors.torch.save({"kv": t}) byte for byte, in one copy: the header, then the
    tensor's memory joined straight in (save() goes through a ~0.5 GB/s serialiser)."""
    code = _ST_DTYPES.get(t.dtype)
    if code is None:
        return st_save({TENSOR_NAME: t})
    n = t.numel() * t.element_size()
    prefix = _st_prefix(tuple(t.shape), code, n)
    # one copy, straight from the (possibly strided) tensor into the final buffer
    buf = _bytearray(len(prefix) + n)
    buf[: len(prefix)] = prefix
    if n:
        _payload(buf, len(prefix), tuple(t.shape), t.dtype, n).copy_(t)
    return buf  # type: ignore[return-value]  # bytes-like, spared the copy bytes() would make


def pack_kv(chunk: torch.Tensor | KVChunk, codec: str = "none", scale: torch.Tensor | None = None
            ) -> tuple[bytes | bytearray | ChunkPieces, ChunkRef]:
    """Serialise a [2, heads, tokens, head_dim] chunk (a tensor on any device, or a KVChunk) into stored
    chunk bytes (current format version: token-major). `scale`: the float32 [2, heads, tokens] scales
    of quantised (fp8) KV, stored beside it as "kv_scale". A KVChunk whose bytes are laid out already is
    only wrapped (codec "none", hashed) or encoded; ChunkPieces come back as they are for codec "none"."""
    tensor = chunk.view if isinstance(chunk, KVChunk) else chunk
    if tensor.dim() != 4 or tensor.shape[0] != 2:
        raise ValueError(f"KV chunk tensor must be [2, heads, tokens, head_dim], got {list(tensor.shape)}")
    if scale is not None:
        if tuple(scale.shape) != tuple(tensor.shape[:3]) or scale.dtype != torch.float32:
            raise ValueError(f"KV scales must be float32 {list(tensor.shape[:3])}, got {scale.dtype} {list(scale.shape)}")
        raw = st_save({TENSOR_NAME: _logical(tensor.detach().cpu(), FORMAT_VERSION).contiguous(),
                       SCALE_NAME: scale.detach().cpu().transpose(1, 2).contiguous()})
        data = encode(codec, raw, tensor.element_size())
        return data, ChunkRef(hash=chunk_hash(data), size=len(data), raw_size=len(raw), codec=codec)  # type: ignore[arg-type]
    buf = chunk.buf if isinstance(chunk, KVChunk) else None
    if buf is not None and codec == "none" and chunk.hash is not None:  # type: ignore[union-attr]
        return buf, ChunkRef(hash=chunk.hash, size=len(buf), raw_size=len(buf), codec="none")  # type: ignore[union-attr,arg-type]
    if isinstance(buf, ChunkPieces):
        buf = buf.joined()
    if buf is None:
        t = _logical(tensor.detach().to("cpu"), FORMAT_VERSION)  # the stored order, as a view
        buf = _st_bytes(t) if t.dtype in _ST_DTYPES else _st_bytes(t.contiguous())
    data = encode(codec, buf, tensor.element_size())
    ref = ChunkRef(hash=chunk_hash(data), size=len(data), raw_size=len(buf), codec=codec)  # type: ignore[arg-type]
    return data, ref


def verify_chunk(data: bytes, ref: ChunkRef, hashed: bool = False) -> None:
    """Check stored bytes against their reference (size, then hash). `hashed`: the caller checked
    these very bytes against `ref` already (on receipt), so only the size is checked again."""
    if len(data) != ref.size:
        raise CorruptCheckpoint(f"chunk {ref.hash}: {len(data)} bytes stored, manifest says {ref.size}")
    if hashed:
        return
    actual = chunk_hash(data)
    if actual != ref.hash:
        raise CorruptCheckpoint(f"chunk {ref.hash}: hash mismatch (stored bytes hash to {actual})")


_RO_LOCK = threading.Lock()
_ro_warned = False


def _view_readonly(raw, offset: int, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """torch.frombuffer of a read-only buffer (bytes): torch warns once per process that such a
    tensor could be written through; ours are only ever read. Take that one warning quietly."""
    global _ro_warned
    if not _ro_warned:
        with _RO_LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = _payload(raw, offset, shape, dtype, nbytes)
            _ro_warned = True
            return t
    return _payload(raw, offset, shape, dtype, nbytes)


def kv_view(
    data: bytes,
    ref: ChunkRef,
    expect_shape: tuple[int, ...] | torch.Size,
    expect_dtype: torch.dtype | str,
    format_version: int = FORMAT_VERSION,
    verified: bool = False,
) -> torch.Tensor:
    """``unpack_kv`` without the final copy: the tensor may share memory with `data` (or with
    the store holding it), so treat it as read-only and copy out of it. Same checks, same errors.
    `expect_shape` is the logical [2, heads, tokens, head_dim]; `format_version` (the manifest's)
    says how the chunk stores it, and the result is that logical view of it either way.
    `verified`: the caller checked these very bytes against `ref` already (their hash is not
    computed twice); the size is checked either way."""
    verify_chunk(data, ref, hashed=verified)  # hash first: never decode bytes we cannot vouch for
    return _logical(_stored_view(data, ref, stored_shape(tuple(expect_shape), format_version), expect_dtype),
                    format_version)


def kv_stream_view(data: bytes, ref: ChunkRef, expect_shape: tuple[int, ...] | torch.Size,
                   expect_dtype: torch.dtype | str, format_version: int = FORMAT_VERSION
                   ) -> tuple[torch.Tensor, xxhash.xxh3_128] | None:
    """kv_view of a codec "none", token-major chunk whose hash is NOT checked yet: its logical view
    and a streaming hash already fed the chunk's header. The caller feeds that the payload in memory
    order as it copies it (each piece hashed just before its copy, so the copy reads it from L2),
    then calls check_streamed before anything it copied is used; None where that does not apply
    (other codecs: never decode unverified bytes; other headers: the full parser) — use kv_view."""
    dtype = _as_dtype(expect_dtype)
    shape = stored_shape(tuple(expect_shape), format_version)
    code = _ST_DTYPES.get(dtype)
    if ref.codec != "none" or format_version < 2 or code is None or len(shape) != 4 or len(data) != ref.size:
        return None
    n = math.prod(shape) * dtype.itemsize
    prefix = _st_prefix(shape, code, n)
    p = len(prefix)
    if n == 0 or len(data) != p + n or data[:p] != prefix:
        return None
    h = xxhash.xxh3_128()
    h.update(prefix)  # the bytes just compared equal to it
    t = _payload(data, p, shape, dtype, n) if isinstance(data, bytearray) else _view_readonly(data, p, shape, dtype, n)
    return _logical(t, format_version), h


def check_streamed(hasher: xxhash.xxh3_128, ref: ChunkRef) -> None:
    """The chunk a kv_stream_view hasher was fed all of hashes to `ref`, else CorruptCheckpoint."""
    actual = hasher.hexdigest()
    if actual != ref.hash:
        raise CorruptCheckpoint(f"chunk {ref.hash}: hash mismatch (stored bytes hash to {actual})")


def _decoded(data: bytes, ref: ChunkRef, dtype: torch.dtype) -> bytes:
    """The verified chunk's safetensors payload (for codec "none": `data` itself, no copy)."""
    if ref.codec == "none":  # decode() would only copy it and check the size
        if len(data) != ref.raw_size:
            raise CorruptCheckpoint(f"chunk {ref.hash}: none data decodes to {len(data)} bytes, "
                                    f"declared {ref.raw_size}")
        return data
    try:
        return decode(ref.codec, data, ref.raw_size, torch.empty((), dtype=dtype).element_size())
    except CorruptCheckpoint as exc:
        raise CorruptCheckpoint(f"chunk {ref.hash}: {exc}") from None


def _parsed(raw: bytes, ref: ChunkRef, want: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """The full safetensors parser, and exactly the tensors `want` names, of those shapes and dtypes."""
    try:
        tensors = st_load(bytes(raw))
    except Exception as exc:  # safetensors raises its own (non-Storage) error types on bad headers
        raise CorruptCheckpoint(f"chunk {ref.hash}: not a valid safetensors payload ({exc})") from None
    if set(tensors) != set(want):
        raise CorruptCheckpoint(f"chunk {ref.hash}: expected tensors {sorted(want)}, found {sorted(tensors)}")
    for name, (shape, dtype) in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise CorruptCheckpoint(f"chunk {ref.hash}: {name} shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype != dtype:
            raise CorruptCheckpoint(f"chunk {ref.hash}: {name} dtype {dtype_name(t.dtype)}, "
                                    f"expected {dtype_name(dtype)}")
    return tensors


def _stored_view(data: bytes, ref: ChunkRef, shape: tuple[int, ...], expect_dtype: torch.dtype | str
                 ) -> torch.Tensor:
    """The verified chunk's stored tensor, checked to be exactly `shape` and the dtype."""
    dtype = _as_dtype(expect_dtype)
    raw = _decoded(data, ref, dtype)
    # Fast path: the exact header this module (and safetensors.torch.save) writes for the expected
    # tensor, followed by exactly its bytes. That is a valid payload of the right shape and dtype.
    code = _ST_DTYPES.get(dtype)
    n = math.prod(shape) * dtype.itemsize if len(shape) == 4 else -1
    if code is not None and n > 0:
        prefix = _st_prefix(shape, code, n)
        p = len(prefix)
        if len(raw) == p + n and raw[:p] == prefix:
            if isinstance(raw, bytearray):
                return _payload(raw, p, shape, dtype, n)
            return _view_readonly(raw, p, shape, dtype, n)
    # Anything else (other header spellings, metadata, wrong shapes): the full parser and its errors.
    return _parsed(raw, ref, {TENSOR_NAME: (shape, dtype)})[TENSOR_NAME]


def kv_scaled_view(data: bytes, ref: ChunkRef, expect_shape: tuple[int, ...] | torch.Size,
                   expect_dtype: torch.dtype | str, verified: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of quantised KV (format version 2 with scales): the [2, heads, tokens, head_dim] values
    and their float32 [2, heads, tokens] scales, verified (unless `verified`) and checked like kv_view."""
    verify_chunk(data, ref, hashed=verified)
    dtype = _as_dtype(expect_dtype)
    st = stored_shape(tuple(expect_shape))
    got = _parsed(_decoded(data, ref, dtype), ref, {TENSOR_NAME: (st, dtype), SCALE_NAME: (st[:3], torch.float32)})
    return got[TENSOR_NAME].transpose(1, 2), got[SCALE_NAME].transpose(1, 2)


def unpack_kv(
    data: bytes,
    ref: ChunkRef,
    expect_shape: tuple[int, ...] | torch.Size,
    expect_dtype: torch.dtype | str,
    format_version: int = FORMAT_VERSION,
) -> torch.Tensor:
    """Verify, decode and parse one chunk; any mismatch is ``CorruptCheckpoint`` naming the chunk.
    The tensor ([2, heads, tokens, head_dim], contiguous) is the caller's own (shares no memory with `data`)."""
    t = kv_view(data, ref, expect_shape, expect_dtype, format_version)
    return t.clone(memory_format=torch.contiguous_format)
