"""A chunk whose stored bytes are left where they lie: its safetensors header, then buffers that
already hold its payload in stored order (a KV pool's own rows: K's runs, then V's), never joined.

A live round's final chunks are cut while their sessions are held, so their rows cannot change
before they are sent: copying them into a chunk buffer first would only cost a pass over every
byte. `in_place_chunk` hashes the pieces where they are and stands for the chunk with a meta
tensor (shape and dtype, no memory) that CheckpointWriter.put_kv recognises; a frame sink sends
the pieces as they are (`sendmsg` of their views). Only codec "none" keeps them unjoined: any
other codec, and any store that keeps bytes, gets them joined (`joined`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import xxhash
from relayout.storage.format.chunks import _ST_DTYPES, _st_prefix, chunk_hash, stored_shape
from relayout.storage.format.codecs import encode
from relayout.storage.format.manifest import ChunkRef


@dataclass(frozen=True)
class ChunkPieces:
    """A chunk's stored bytes as the concatenation of `views` (`size` bytes in all)."""

    views: tuple[memoryview, ...]
    size: int

    def __len__(self) -> int:
        return self.size

    def joined(self) -> bytearray:
        return bytearray().join(self.views)


def in_place_chunk(shape: tuple[int, ...], dtype: torch.dtype, payload: list[memoryview]) -> torch.Tensor | None:
    """A stand-in for the chunk of logical `shape` ([2, heads, tokens, head_dim]) whose stored
    payload is the concatenation of `payload` (token-major K rows, then V rows), hashed now; None
    where the format cannot take it so (another dtype, a size that does not add up)."""
    code = _ST_DTYPES.get(dtype)
    n = math.prod(shape) * dtype.itemsize
    if code is None or len(shape) != 4 or n == 0 or sum(v.nbytes for v in payload) != n:
        return None
    views = (memoryview(_st_prefix(stored_shape(shape), code, n)), *(v.cast("B") for v in payload))
    h = xxhash.xxh3_128()
    for v in views:
        h.update(v)
    size = views[0].nbytes + n
    t = torch.empty(shape, dtype=dtype, device="meta")
    t._relayout_pieces = (ChunkPieces(views, size), h.hexdigest())  # type: ignore[attr-defined]
    return t


def pack_in_place(t: torch.Tensor, codec: str) -> tuple[ChunkPieces | bytearray, ChunkRef] | None:
    """CheckpointWriter.put_kv's form of an in_place_chunk tensor: its pieces and their reference
    (codec "none"), its bytes joined and left to the codec (`None`: `t` is an ordinary tensor)."""
    got = getattr(t, "_relayout_pieces", None)
    if got is None:
        return None
    pieces, digest = got
    if codec == "none":
        return pieces, ChunkRef(hash=digest, size=pieces.size, raw_size=pieces.size, codec="none")  # type: ignore[arg-type]
    raw = pieces.joined()
    data = encode(codec, raw, t.element_size())
    return data, ChunkRef(hash=chunk_hash(data), size=len(data), raw_size=len(raw), codec=codec)  # type: ignore[arg-type]
