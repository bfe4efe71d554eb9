"""Chunk codecs: none, zstd and zstd-planes (byte planes, each stored raw or as its own zstd frame).

KV values are floats whose low mantissa bytes are noisy while sign/exponent bytes repeat;
grouping byte i of every element together ("planes") lets zstd find that redundancy, and
keeping each plane apart lets the noisy ones be stored as they are instead of spending zstd
time on them. Each chunk is encoded on one core by default; parallelism comes from the callers,
which encode and decode many chunks at once. ``encode(..., threads=n)`` lets zstd's own
multi-threaded mode compress a big plane (>= _MT_MIN_BYTES: a chunk-sized plane, ~128-512 KiB,
is below the job size at which zstd starts splitting work) on n workers: one big chunk sent on
a fast link then need not wait for one core. Its frames are plain zstd, decoded as any other.

Decoding is bounded by the declared ``raw_size``: output is produced incrementally and
refused as soon as it would exceed it, so a chunk whose declared sizes lie cannot make
us allocate more than it honestly decodes to (zstd frames may claim any content size).
"""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from collections.abc import Sequence

import numpy as np
import zstandard
from relayout.storage.errors import CorruptCheckpoint

CODECS: tuple[str, ...] = ("none", "zstd", "zstd-planes")
ZSTD_LEVEL = 1  # ~2x faster than level 3 on KV data for a ratio within ~4%
_READ_STEP = 8 * 1024 * 1024

# zstd-planes layout (see docs/format.md): a header (PLANES_MARK, the element size k, the
# elements per block B), one record (mode, stored length) per block and plane, then per block
# of B elements its k planes (byte i of each element), then the raw_size % k bytes that fill
# no element. Blocks bound the memory a plane is built in and let each part of a big chunk be
# judged on its own. Chunks written before this layout are one zstd frame of the shuffled bytes;
# a zstd frame starts with 0x28 (magic 0xFD2FB528, little-endian): the first byte tells them apart.
PLANES_MARK = 0x01
_MAX_PLANES = 16
BLOCK_ELEMENTS = 512 * 1024  # a 2 MiB float32 chunk is one block; zstd level 1's window is 512 KiB
_PLANE_RAW, _PLANE_ZSTD = 0, 1
_HEADER = struct.Struct("<BBI")
_RECORD = np.dtype([("mode", "u1"), ("size", "<u4")])  # packed: 5 bytes
# Which zstd settings a plane gets is decided on a sample: an eighth of the plane, in windows
# spread over it (at least four: a KV chunk's K half and V half differ). Sign/exponent planes
# compress by their skewed byte histogram: zstd level 1 with its smallest match table finds few
# matches and Huffman-codes the rest (~2x faster and a few % denser than plain level 1 there).
# Where the sample shows repeats too (rows of KV repeat whole: layer-0 V of a repeated token), a
# double-fast match finder with 4-byte matches is taken: denser and faster than plain level 1 there.
# One-byte values (fp8: all of a value is one plane) always get it, untried. Noise planes (low mantissa bytes) shrink only by those
# repeats: a negative level finds them without Huffman-coding the noise, 2-3x faster than level 1
# and as dense, cut into blocks of _MATCH_BLOCK_BYTES (a block start ends the skipping that fast
# match finders do through input without matches). A plane that shrinks by none is stored raw:
# noise then costs a copy, not a zstd pass. The frames are plain zstd: any reader decodes them.
_SAMPLE_MIN_WINDOWS, _SAMPLE_WINDOW_BYTES, _SAMPLE_FRACTION = 4, 16 * 1024, 8
_SAMPLE_WHOLE_BELOW = 32 * 1024  # a plane this small is its own sample
_HISTOGRAM_ARGS: tuple[int, dict] = (ZSTD_LEVEL, {"min_match": 7, "hash_log": 6})
_DENSE_ARGS: tuple[int, dict] = (ZSTD_LEVEL, {"strategy": zstandard.STRATEGY_DFAST, "min_match": 4})
_HISTOGRAM_PARAMS = zstandard.ZstdCompressionParameters.from_level(_HISTOGRAM_ARGS[0], **_HISTOGRAM_ARGS[1])
_DENSE_PARAMS = zstandard.ZstdCompressionParameters.from_level(_DENSE_ARGS[0], **_DENSE_ARGS[1])
_REPEAT_PARAMS = zstandard.ZstdCompressionParameters.from_level(-2, hash_log=16)
_MIN_HISTOGRAM_RATIO = 1.1  # below this a plane is noise: not worth a literal coder
_MIN_REPEAT_RATIO = 1.03  # below this a noise plane is stored raw
_MATCH_BLOCK_BYTES = 16 * 1024
_DENSE_PREMIUM = 1.05  # the match coder is taken over the histogram coder if its sample is this much smaller
# A plane its histogram alone shrinks this much (a sign/exponent plane) is not tried with the dense
# finder: there its 4-byte matches are mostly chance runs of common bytes, coded worse than by the
# histogram and found ~5x slower (the trial alone cost ~70% of the plane's own compression)
_DENSE_MAX_HISTOGRAM_RATIO = 2.0
# zstd's multi-threaded mode: jobs of _MT_JOB_BYTES (its minimum is 512 KiB), used from two jobs on
_MT_JOB_BYTES = 1 << 20
_MT_MIN_BYTES = 2 * _MT_JOB_BYTES
# with threads, blocks of 2 Mi elements (not BLOCK_ELEMENTS): the least that gives a plane two jobs.
# Bigger blocks cost ratio on float KV (each plane is judged over a wider span): 2-3% at 2 Mi
_MT_BLOCK_ELEMENTS = 2 * 2**20
_CONTEXTS = threading.local()  # zstd contexts are not thread-safe; one set per thread, reused


def _coders() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdCompressor, zstandard.ZstdCompressor]:
    """This thread's (histogram, dense match, repeat) compressors: a fresh context per plane
    costs ~15% of a level-1 pass on chunk-sized planes."""
    c = getattr(_CONTEXTS, "coders", None)
    if c is None:
        c = _CONTEXTS.coders = tuple(zstandard.ZstdCompressor(compression_params=p)
                                     for p in (_HISTOGRAM_PARAMS, _DENSE_PARAMS, _REPEAT_PARAMS))
    return c


def _mt_coder(dense: bool, threads: int) -> zstandard.ZstdCompressor:
    """This thread's histogram (or dense) compressor on `threads` zstd workers (kept: so is its pool)."""
    cache = getattr(_CONTEXTS, "mt", None)
    if cache is None:
        cache = _CONTEXTS.mt = {}
    c = cache.get((dense, threads))
    if c is None:
        level, kw = _DENSE_ARGS if dense else _HISTOGRAM_ARGS
        params = zstandard.ZstdCompressionParameters.from_level(level, threads=threads, job_size=_MT_JOB_BYTES, **kw)
        c = cache[(dense, threads)] = zstandard.ZstdCompressor(compression_params=params)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_CONTEXTS, "dctx", None)
    if d is None:
        d = _CONTEXTS.dctx = zstandard.ZstdDecompressor()
    return d


try:  # a bytearray of n bytes WITHOUT zero-filling them first (every byte is written right after)
    _new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
    _new_bytearray.restype = ctypes.py_object
    _new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
except AttributeError:  # not CPython: a zeroed one
    _new_bytearray = None


def new_buffer(n: int) -> bytearray:
    """A bytearray of `n` bytes whose contents are undefined (not zero-filled): for a buffer every
    byte of which is written before it is read (a decoded chunk, a received frame's payload)."""
    return bytearray(n) if _new_bytearray is None else _new_bytearray(None, n)


def _fill_plane(src: np.ndarray, words: np.ndarray | None, tmp: np.ndarray | None, k: int, i: int,
                dst: np.ndarray) -> None:
    """dst = byte i (memory order) of each k-byte element of src, k > 1 (vectorised, no Python loop)."""
    if words is None:  # an element size with no integer view: a strided gather
        np.copyto(dst, src.reshape(-1, k)[:, i])
    elif i == 0:
        np.copyto(dst, words, casting="unsafe")  # truncating cast keeps the low byte
    else:
        assert tmp is not None
        np.right_shift(words, 8 * i, out=tmp)
        np.copyto(dst, tmp, casting="unsafe")


def _word_view(a: np.ndarray, k: int) -> np.ndarray | None:
    """`a` as little-endian k-byte unsigned ints (byte i of the memory = bits 8i..8i+7), if numpy has them."""
    return a.view(f"<u{k}") if k in (2, 4, 8) else None


def _compress_in_blocks(cctx: zstandard.ZstdCompressor, data: np.ndarray) -> bytes:
    """One zstd frame of `data`, cut into blocks of _MATCH_BLOCK_BYTES. zstd's fast strategies skip
    ever faster through input without matches and slow down only at a match or a block start:
    in one 128 KiB block, a noisy K half would make them skip past the repeats of the V half after it."""
    obj = cctx.compressobj(size=len(data))
    parts = []
    for lo in range(0, len(data), _MATCH_BLOCK_BYTES):
        parts.append(obj.compress(data[lo : lo + _MATCH_BLOCK_BYTES]))
        parts.append(obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    parts.append(obj.flush())
    return b"".join(parts)


def _plane_frame(plane: np.ndarray, k: int, threads: int = 0) -> bytes | None:
    """`plane` (of a k-byte element) as a zstd frame with the settings worth spending on it (judged
    on a sample of it), or None: store it raw. `threads` > 1: zstd workers for a plane big enough."""
    m = len(plane)
    hist, dense, repeat = _coders()
    if threads > 1 and m >= _MT_MIN_BYTES:
        hist, dense = _mt_coder(False, threads), _mt_coder(True, threads)
    if k == 1:
        # one plane holds all of each value (fp8): both its skewed histogram and its repeats count, and
        # the dense coder wins on either (fp8 KV: 4-byte matches make even a chunk with no repeated rows
        # 2% denser than the histogram alone, 40% with them). No trial on a sample: trying both coders
        # cost a quarter of the pass; a plane of noise costs one fast zstd pass and is stored raw
        frame = dense.compress(plane)
        return frame if len(frame) < m else None
    whole = m <= _SAMPLE_WHOLE_BELOW
    if whole:
        sample = plane
    else:
        windows = max(_SAMPLE_MIN_WINDOWS, m // (_SAMPLE_FRACTION * _SAMPLE_WINDOW_BYTES))
        step, w = m // windows, m // (_SAMPLE_FRACTION * windows)
        sample = np.concatenate([plane[j * step : j * step + w] for j in range(windows)])
    hist_sample = hist.compress(sample)
    if len(sample) >= _MIN_HISTOGRAM_RATIO * len(hist_sample):  # a skewed histogram: a literal coder
        dense_sample = (dense.compress(sample) if len(sample) < _DENSE_MAX_HISTOGRAM_RATIO * len(hist_sample)
                        else None)
        if dense_sample is not None and len(hist_sample) > _DENSE_PREMIUM * len(dense_sample):  # repeats too
            frame = dense_sample if whole else dense.compress(plane)
        else:
            frame = hist_sample if whole else hist.compress(plane)
    else:  # noise: only repeats shrink it
        repeat_sample = _compress_in_blocks(repeat, sample)
        if len(sample) < _MIN_REPEAT_RATIO * len(repeat_sample):
            return None
        frame = repeat_sample if whole else _compress_in_blocks(repeat, plane)
    return frame if len(frame) < m else None


def _encode_planes_into(out: bytearray, raw: bytes, k: int, per_block: int, threads: int = 0) -> int:
    """Write the zstd-planes layout of `raw` into `out` (room for every plane raw); return its length."""
    m, tail = divmod(len(raw), k)
    blocks = -(-m // per_block)
    _HEADER.pack_into(out, 0, PLANES_MARK, k, per_block)
    buf = np.frombuffer(out, dtype=np.uint8)
    records = np.frombuffer(out, dtype=_RECORD, count=blocks * k, offset=_HEADER.size)
    src = np.frombuffer(raw, dtype=np.uint8)
    words = _word_view(src[: m * k], k)
    tmp = np.empty(min(m, per_block), dtype=words.dtype) if words is not None else None
    pos = _HEADER.size + records.nbytes
    for b in range(blocks):
        lo, hi = b * per_block, min(m, (b + 1) * per_block)
        block_words = words[lo:hi] if words is not None else None
        block_tmp = tmp[: hi - lo] if tmp is not None else None
        for i in range(k):
            plane = buf[pos : pos + hi - lo]  # built in place: a raw plane is never copied again
            if k == 1:  # the source is the plane: compressed from there, copied only if stored raw
                frame = _plane_frame(src[lo:hi], 1, threads)
                if frame is None:
                    np.copyto(plane, src[lo:hi])
            else:
                _fill_plane(src[lo * k : hi * k], block_words, block_tmp, k, i, plane)
                frame = _plane_frame(plane, k, threads)
            if frame is None:
                records[b * k + i] = (_PLANE_RAW, hi - lo)
            else:
                buf[pos : pos + len(frame)] = np.frombuffer(frame, dtype=np.uint8)
                records[b * k + i] = (_PLANE_ZSTD, len(frame))
            pos += int(records[b * k + i]["size"])
    buf[pos : pos + tail] = src[m * k :]
    return pos + tail


def _encode_planes(raw: bytes, itemsize: int, threads: int = 0) -> bytearray:
    k = itemsize if 1 <= itemsize <= _MAX_PLANES else 1
    # zstd's workers need planes of several jobs: with threads, a big chunk is cut in fewer, bigger blocks
    per_block = BLOCK_ELEMENTS if threads <= 1 else max(BLOCK_ELEMENTS, _MT_BLOCK_ELEMENTS)
    blocks = -(-(len(raw) // k) // per_block)
    out = new_buffer(_HEADER.size + blocks * k * _RECORD.itemsize + len(raw))  # the most it takes: all raw
    end = _encode_planes_into(out, raw, k, per_block, threads)  # its numpy views of `out` are gone once it returns
    del out[end:]
    return out


def encode(codec: str, raw: bytes, itemsize: int, threads: int = 0) -> bytes:
    """`raw` stored with `codec`. `threads` > 1: zstd compresses inputs (zstd-planes: planes) of at
    least _MT_MIN_BYTES on that many workers of its own (plain zstd frames: decoding is unchanged)."""
    if codec == "none":
        return raw  # bytes-like as given: no copy
    if codec == "zstd":
        mt = threads if threads > 1 and len(raw) >= _MT_MIN_BYTES else 0
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=mt).compress(raw)
    if codec == "zstd-planes":
        return _encode_planes(raw, itemsize, threads)  # type: ignore[return-value]  # bytes-like, spared a copy
    raise ValueError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")


def _bounded_decompress(data: bytes, raw_size: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpoint(f"zstd data is corrupt: {exc}") from None
    if declared >= 0:
        # Fast path (one-shot, ~2x the streaming speed). The frame's content size must match
        # raw_size exactly, so the buffer it allocates is bounded by what we declared.
        if declared != raw_size:
            raise CorruptCheckpoint(f"zstd frame decodes to {declared} bytes, declared {raw_size}")
        try:
            out = _decompressor().decompress(data, max_output_size=raw_size)
        except zstandard.ZstdError as exc:
            raise CorruptCheckpoint(f"zstd data is corrupt: {exc}") from None
        if len(out) != raw_size:
            raise CorruptCheckpoint(f"zstd data decodes to {len(out)} bytes, declared {raw_size}")
        return out
    # No content size in the frame header: decode incrementally and stop past raw_size.
    out = bytearray()
    try:
        # A fresh decompressor per chunk: zstd contexts are not thread-safe.
        reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
        while True:
            piece = reader.read(min(_READ_STEP, raw_size - len(out) + 1))
            if not piece:
                break
            out += piece
            if len(out) > raw_size:
                raise CorruptCheckpoint(f"zstd data decodes to more than the declared {raw_size} bytes")
    except zstandard.ZstdError as exc:
        raise CorruptCheckpoint(f"zstd data is corrupt: {exc}") from None
    return bytes(out)


def _unshuffle(data: bytes, itemsize: int) -> bytes:
    """Inverse of the shuffle chunks written before the per-plane layout got (one zstd frame)."""
    if itemsize <= 1 or len(data) % itemsize:
        return data  # such chunks were stored unshuffled
    out = bytearray(len(data))
    np.frombuffer(out, dtype=np.uint8).reshape(-1, itemsize)[:] = np.frombuffer(data, np.uint8).reshape(itemsize, -1).T
    return out  # type: ignore[return-value]  # bytes-like


def _plane_records(data: bytes, raw_size: int) -> tuple[int, int, np.ndarray]:
    """Parse and check the zstd-planes header: element size, elements per block, the records."""
    if len(data) < _HEADER.size:
        raise CorruptCheckpoint("zstd-planes header is truncated")
    _, k, per_block = _HEADER.unpack_from(data)
    if not 1 <= k <= _MAX_PLANES or per_block < 1:
        raise CorruptCheckpoint(f"zstd-planes header is corrupt ({k} planes, blocks of {per_block})")
    m, tail = divmod(raw_size, k)
    count = -(-m // per_block) * k
    if _HEADER.size + count * _RECORD.itemsize > len(data):  # checked before anything is allocated
        raise CorruptCheckpoint(f"zstd-planes header is truncated ({count} plane records for {raw_size} bytes)")
    records = np.frombuffer(data, dtype=_RECORD, count=count, offset=_HEADER.size)
    plane_len = np.minimum(per_block, m - np.arange(count) // k * per_block)
    modes, sizes = records["mode"], records["size"].astype(np.int64)
    if ((modes != _PLANE_RAW) & (modes != _PLANE_ZSTD)).any() or ((modes == _PLANE_RAW) & (sizes != plane_len)).any():
        raise CorruptCheckpoint(f"zstd-planes plane records are corrupt for {raw_size} bytes")
    if _HEADER.size + records.nbytes + int(sizes.sum()) + tail != len(data):
        raise CorruptCheckpoint(f"zstd-planes lengths do not add up to the {len(data)} stored bytes")
    return k, per_block, records


def _decode_planes(data: bytes, raw_size: int) -> bytes | bytearray:
    k, per_block, records = _plane_records(data, raw_size)
    m = raw_size // k
    if k == 1 and len(records) == 1 and records[0]["mode"] == _PLANE_ZSTD:  # one frame (a chunk of fp8):
        return _bounded_decompress(memoryview(data)[len(data) - int(records[0]["size"]) :], m)  # no copy
    out = new_buffer(raw_size)  # every byte is written below: plane 0 of a block sets its words whole
    dst = np.frombuffer(out, dtype=np.uint8)
    words = _word_view(dst[: m * k], k)
    tmp = np.empty(min(m, per_block), dtype=words.dtype) if words is not None and k > 1 else None
    view = memoryview(data)
    pos = _HEADER.size + records.nbytes
    for r, (mode, size) in enumerate(records.tolist()):
        b, i = divmod(r, k)
        lo, hi = b * per_block, min(m, (b + 1) * per_block)
        piece = view[pos : pos + size]
        pos += size
        # a frame must decode to exactly its plane's length: never more is allocated
        plane = np.frombuffer(piece if mode == _PLANE_RAW else _bounded_decompress(piece, hi - lo), dtype=np.uint8)
        if k == 1:
            dst[lo:hi] = plane
        elif words is None:
            dst[lo * k : hi * k].reshape(-1, k)[:, i] = plane
        elif i == 0:
            np.copyto(words[lo:hi], plane)
        else:
            assert tmp is not None
            block_tmp = tmp[: hi - lo]
            np.left_shift(plane, 8 * i, out=block_tmp, dtype=tmp.dtype)
            np.bitwise_or(words[lo:hi], block_tmp, out=words[lo:hi])
    dst[m * k :] = np.frombuffer(view[pos:], dtype=np.uint8)
    return out


def decode(codec: str, data: bytes, raw_size: int, itemsize: int) -> bytes:
    """Decode ``data``; the result is exactly ``raw_size`` bytes or ``CorruptCheckpoint``.
    ``itemsize`` is only needed for zstd-planes chunks written before the per-plane layout."""
    if codec == "none":
        out = bytes(data)
    elif codec == "zstd":
        out = _bounded_decompress(data, raw_size)
    elif codec == "zstd-planes":
        if len(data) and data[0] == PLANES_MARK:
            out = _decode_planes(data, raw_size)  # type: ignore[assignment]  # bytes-like
        else:  # the earlier layout: one zstd frame of the shuffled bytes
            out = _unshuffle(_bounded_decompress(data, raw_size), itemsize)
    else:
        raise CorruptCheckpoint(f"unknown codec {codec!r}")
    if len(out) != raw_size:
        raise CorruptCheckpoint(f"{codec} data decodes to {len(out)} bytes, declared {raw_size}")
    return out


def measure_codecs(raw: bytes | Sequence[bytes], itemsize: int, reps: int = 1,
                   threads: int = 0) -> dict[str, dict[str, float]]:
    """Per codec: ratio (raw/stored), gbps (raw bytes through encode+decode), and each direction alone.
    `raw` is one buffer or a list of chunks (each encoded on its own, as pack_kv does); speeds are of
    one thread (per core) unless `threads` > 1 (then encode is given zstd's workers: totals, wall
    clock); each direction the best of `reps` tries."""
    chunks = [raw] if isinstance(raw, (bytes, bytearray, memoryview)) else list(raw)
    n = sum(len(c) for c in chunks)
    results: dict[str, dict[str, float]] = {}
    for name in CODECS:
        t_enc = t_dec = float("inf")
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            enc = [encode(name, c, itemsize, threads) for c in chunks]
            t1 = time.perf_counter()
            dec = [decode(name, e, len(c), itemsize) for e, c in zip(enc, chunks, strict=True)]
            t2 = time.perf_counter()
            t_enc, t_dec = min(t_enc, t1 - t0), min(t_dec, t2 - t1)
            if any(d != c for d, c in zip(dec, chunks, strict=True)):
                raise RuntimeError(f"codec {name} is not lossless")
        gb = n / 1e9
        results[name] = {
            "ratio": n / max(sum(len(e) for e in enc), 1),
            "gbps": gb / max(t_enc + t_dec, 1e-9),
            "encode_gbps": gb / max(t_enc, 1e-9),
            "decode_gbps": gb / max(t_dec, 1e-9),
        }
    return results
