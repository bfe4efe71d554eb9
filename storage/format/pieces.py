"""A chunk whose stored bytes are left where they lie: its safetensors header, then buffers that
already hold its payload in stored order (a KV pool's own rows: K's runs, then V's), never joined.

A live round's final chunks are cut while their sessions are held, so their rows cannot change
before they are sent: copying them into a chunk buffer first would only cost a pass over every
byte. `in_place_chunk` hashes the pieces where they are and makes a `KVChunk` of them (its view a
meta tensor: shape and dtype, no memory); a frame sink sends the pieces as they are (`sendmsg` of
their views). Only codec "none" keeps them unjoined: any other codec, and any store that keeps
bytes, gets them joined (`ChunkPieces.joined`).
"""

from __future__ import annotations

import math

import torch
import xxhash
from relayout.storage.format.chunks import _ST_DTYPES, ChunkPieces, KVChunk, _st_prefix, stored_shape


def in_place_chunk(shape: tuple[int, ...], dtype: torch.dtype, payload: list[memoryview]) -> KVChunk | None:
    """The chunk of logical `shape` ([2, heads, tokens, head_dim]) whose stored payload is the
    concatenation of `payload` (token-major K rows, then V rows), hashed now; None where the format
    cannot take it so (another dtype, a size that does not add up)."""
    code = _ST_DTYPES.get(dtype)
    n = math.prod(shape) * dtype.itemsize
    if code is None or len(shape) != 4 or n == 0 or sum(v.nbytes for v in payload) != n:
        return None
    views = (memoryview(_st_prefix(stored_shape(shape), code, n)), *(v.cast("B") for v in payload))
    h = xxhash.xxh3_128()
    for v in views:
        h.update(v)
    return KVChunk(torch.empty(shape, dtype=dtype, device="meta"), ChunkPieces(views, views[0].nbytes + n), h.hexdigest())
