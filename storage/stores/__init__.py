"""Checkpoint stores: the Store interface, its backends, and URI resolution.

``open_store("file:///abs/path", allowed_roots=[...])`` → LocalStore,
``open_store("s3://bucket/prefix")`` → S3Store. MemoryStore backs streams and tests.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from relayout.storage.errors import CheckpointNotFound, ChunkMissing
from relayout.storage.stores.base import Store, check_hash, check_id
from relayout.storage.stores.local import LocalStore
from relayout.storage.stores.s3 import S3Store

__all__ = ["Store", "LocalStore", "S3Store", "MemoryStore", "open_store"]

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._=-]{1,255}$")


class MemoryStore(Store):
    """Dict-backed store (thread-safe); chunks and manifests live only in this process."""

    def __init__(self) -> None:
        self.identity = f"memory://{id(self):x}"
        self._lock = threading.Lock()
        self._chunks: dict[str, tuple[bytes, float]] = {}
        self._manifests: dict[str, bytes] = {}

    def has_chunk(self, h: str) -> bool:
        with self._lock:
            return check_hash(h) in self._chunks

    def _put_chunk_new(self, h: str, data: bytes) -> None:
        # a chunk buffer handed to a store is the store's from then on (writers build a fresh
        # one per chunk), so bytes and bytearrays are kept as they are: no copy of the KV
        kept = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        with self._lock:
            self._chunks.setdefault(h, (kept, time.time()))

    def _touch_chunk(self, h: str) -> None:
        with self._lock:
            if h in self._chunks:
                self._chunks[h] = (self._chunks[h][0], time.time())

    def get_chunk(self, h: str) -> bytes:
        with self._lock:
            try:
                return self._chunks[check_hash(h)][0]
            except KeyError:
                raise ChunkMissing(f"chunk {h} not found in memory store") from None

    def _iter_chunks(self) -> Iterator[tuple[str, float]]:
        with self._lock:
            items = [(h, t) for h, (_, t) in self._chunks.items()]
        yield from items

    def _delete_chunk(self, h: str) -> None:
        with self._lock:
            self._chunks.pop(h, None)

    def put_manifest(self, checkpoint_id: str, data: bytes) -> None:
        with self._lock:
            self._manifests[check_id(checkpoint_id)] = bytes(data)

    def get_manifest(self, checkpoint_id: str) -> bytes:
        with self._lock:
            try:
                return self._manifests[check_id(checkpoint_id)]
            except KeyError:
                raise CheckpointNotFound(f"checkpoint {checkpoint_id} not found in memory store") from None

    def list_checkpoints(self) -> list[str]:
        with self._lock:
            return sorted(self._manifests)

    def _delete_manifest(self, checkpoint_id: str) -> None:
        with self._lock:
            self._manifests.pop(checkpoint_id, None)

    def chunk_hashes(self) -> list[str]:
        with self._lock:
            return list(self._chunks)

    @property
    def chunk_count(self) -> int:
        with self._lock:
            return len(self._chunks)


def _inside(path: str, roots: list[Path]) -> bool:
    for root in roots:
        r = os.path.realpath(root)
        if os.path.commonpath([path, r]) == r:
            return True
    return False


def open_store(uri: str, allowed_roots: list[Path] | None = None) -> Store:
    """Resolve a destination URI to a Store; ValueError (clear message) for anything unsafe."""
    if not isinstance(uri, str) or "\x00" in uri or len(uri) > 4096:
        raise ValueError("store URI must be a string without NUL bytes, at most 4096 characters")
    parts = urlsplit(uri)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise ValueError(f"file URI must be file:///absolute/path, got {uri!r}")
        path = unquote(parts.path)
        if "\x00" in path or not os.path.isabs(path):
            raise ValueError(f"file URI must name an absolute path, got {uri!r}")
        real = os.path.realpath(path)  # resolves symlinks and '..' before the containment check
        if allowed_roots is not None and not _inside(real, list(allowed_roots)):
            allowed = ", ".join(str(r) for r in allowed_roots) or "(none)"
            raise ValueError(f"store path {real} is outside the allowed roots: {allowed}")
        return LocalStore(real)
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET_RE.fullmatch(bucket):
            raise ValueError(f"invalid S3 bucket name {bucket!r} in {uri!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"S3 URI must be s3://bucket/prefix, got {uri!r}")
        segments = [s for s in parts.path.split("/") if s]
        for seg in segments:
            if seg in (".", "..") or not _PREFIX_SEGMENT_RE.fullmatch(seg):
                raise ValueError(f"invalid S3 prefix segment {seg!r} in {uri!r}")
        return S3Store(bucket, "/".join(segments))
    raise ValueError(f"unsupported store URI {uri!r}: use file:///absolute/path or s3://bucket/prefix")
