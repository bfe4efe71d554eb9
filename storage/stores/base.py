"""The Store interface: content-addressed chunks plus manifests committed last.

Subclasses provide a handful of primitives; deletion and garbage collection are
written once here so every backend has the same reference semantics.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

from relayout.storage.errors import CheckpointNotFound, CorruptCheckpoint
from relayout.storage.format.chunks import chunk_hash
from relayout.storage.format.manifest import HASH_PATTERN, ID_PATTERN, ChunkRef, KVEntry, Manifest

ID_RE = re.compile(ID_PATTERN)
HASH_RE = re.compile(HASH_PATTERN)

# Chunks that an in-flight CheckpointWriter / StreamReceiver has put (or found already
# present) but whose manifest is not committed yet. Deletion and GC skip them, so
# "put_chunk is a no-op when present" cannot race with a delete removing that chunk.
# Keyed by Store.identity so separate Store objects on the same location share pins.
_PINS: dict[str, Counter[str]] = {}
_PIN_LOCK = threading.Lock()


def check_id(checkpoint_id: str) -> str:
    if not isinstance(checkpoint_id, str) or not ID_RE.fullmatch(checkpoint_id):
        raise ValueError(f"invalid checkpoint id {checkpoint_id!r} (allowed: {ID_PATTERN})")
    return checkpoint_id


def check_hash(h: str) -> str:
    if not isinstance(h, str) or not HASH_RE.fullmatch(h):
        raise ValueError(f"invalid chunk hash {h!r} (expected 32 lowercase hex digits)")
    return h


class Store:
    """Abstract checkpoint store. Subclasses implement the ``_``-prefixed primitives."""

    identity: str = ""

    # ---- primitives -------------------------------------------------------------------
    def _put_chunk_new(self, h: str, data: bytes) -> None:
        raise NotImplementedError

    def _touch_chunk(self, h: str) -> None:
        """Mark an existing chunk as recently used (protects it from age-based GC)."""

    def has_chunk(self, h: str) -> bool:
        raise NotImplementedError

    def get_chunk(self, h: str) -> bytes:
        raise NotImplementedError

    def put_manifest(self, checkpoint_id: str, data: bytes) -> None:
        raise NotImplementedError

    def get_manifest(self, checkpoint_id: str) -> bytes:
        raise NotImplementedError

    def list_checkpoints(self) -> list[str]:
        raise NotImplementedError

    def _delete_manifest(self, checkpoint_id: str) -> None:
        raise NotImplementedError

    def _iter_chunks(self) -> Iterator[tuple[str, float]]:
        """(hash, last-modified unix time) of every stored chunk."""
        raise NotImplementedError

    def _delete_chunk(self, h: str) -> None:
        raise NotImplementedError

    def _cleanup_partial(self, older_than: float) -> int:
        """Remove backend-specific leftovers (temp files, multipart uploads); return count."""
        return 0

    # ---- shared behaviour ---------------------------------------------------------------
    # a chunk left in pieces where it lies (storage.format.chunks.ChunkPieces) may be handed over as
    # such (a stream sends them as they are); a store that keeps bytes gets them joined
    takes_pieces = False
    # chunks a live round's receiving store already had written into the KV pool as they arrived (its
    # import skips them: engine.moves.kv_stream); no other store has any
    placed: Mapping[tuple, tuple] = MappingProxyType({})

    def put_kv_chunk(self, entry: KVEntry, data: bytes, dtype: str) -> None:
        """CheckpointWriter.put_kv's chunk, with the entry it was written for (`entry.chunk` its
        reference, hashed from these bytes a moment ago). A store keeps the chunk; a stream may frame
        the entry with it."""
        self.put_chunk(entry.chunk.hash, data, hashed=True, ref=entry.chunk)

    def put_chunk(self, h: str, data: bytes, *, hashed: bool = False, ref: ChunkRef | None = None) -> None:
        """Store a chunk under its content hash; a no-op when already present. `hashed=True`: the
        caller computed `h` from these very bytes a moment ago (pack_kv), so they are not hashed again.
        `ref`: the chunk's full reference when the caller has it (stores that frame chunks need it)."""
        check_hash(h)
        actual = h if hashed else chunk_hash(data)
        if actual != h:
            raise CorruptCheckpoint(f"chunk {h}: data hashes to {actual}; refusing to store it")
        if self.has_chunk(h):
            self._touch_chunk(h)
            return
        self._put_chunk_new(h, data)

    def put_unverified(self, h: str, data: bytes) -> None:
        """Hold a chunk whose bytes its reader will hash (StreamReceiver(verify=False)). A store
        that does not track unverified chunks hashes them now, as put_chunk does."""
        self.put_chunk(h, data)

    def unverified(self, h: str) -> bool:
        """The chunk is held but its bytes were not hashed yet (only a staging store takes chunks so,
        migrate.protocol.received.ReceivedChunks; whoever reads one verifies it, then `mark_verified`)."""
        return False

    def mark_verified(self, h: str) -> None:
        """The reader hashed the chunk's bytes to `h`."""

    def pin(self, h: str) -> None:
        """Protect a chunk from delete/GC until ``unpin`` (held by in-flight writers)."""
        with _PIN_LOCK:
            _PINS.setdefault(self.identity, Counter())[h] += 1

    def unpin(self, hashes: Iterable[str]) -> None:
        with _PIN_LOCK:
            pins = _PINS.get(self.identity, Counter())
            for h in hashes:
                pins[h] -= 1
                if pins[h] <= 0:
                    del pins[h]

    def _is_pinned(self, h: str) -> bool:
        with _PIN_LOCK:
            return _PINS.get(self.identity, Counter())[h] > 0

    def _referenced(self, exclude: str | None = None) -> set[str] | None:
        """Every chunk hash some committed manifest references; None if one is unreadable."""
        refs: set[str] = set()
        for cid in self.list_checkpoints():
            if cid == exclude:
                continue
            try:
                m = Manifest.parse(self.get_manifest(cid))
            except CheckpointNotFound:
                continue  # deleted concurrently
            except CorruptCheckpoint:
                return None  # cannot tell what it references: keep every chunk
            refs.update(e.chunk.hash for e in m.kv_entries)
        return refs

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        """Remove a manifest, then its chunks that no other manifest (or in-flight writer) uses."""
        raw = self.get_manifest(check_id(checkpoint_id))  # CheckpointNotFound if absent
        try:
            own = {e.chunk.hash for e in Manifest.parse(raw).kv_entries}
        except CorruptCheckpoint:
            own = set()  # leave its chunks to cleanup_incomplete()
        self._delete_manifest(checkpoint_id)
        others = self._referenced(exclude=checkpoint_id)
        if others is None:
            return
        for h in own - others:
            if not self._is_pinned(h):
                self._delete_chunk(h)

    def cleanup_incomplete(self, max_age_s: float = 3600.0) -> int:
        """Remove partial writes and unreferenced chunks older than ``max_age_s``; return count.

        The age threshold protects checkpoints being written right now by other processes
        (their chunks exist before their manifest does).
        """
        cutoff = time.time() - max_age_s
        removed = self._cleanup_partial(cutoff)
        refs = self._referenced()
        if refs is None:
            return removed
        for h, mtime in list(self._iter_chunks()):
            if h not in refs and mtime < cutoff and not self._is_pinned(h):
                self._delete_chunk(h)
                removed += 1
        return removed

    def checkpoint_chunks(self, checkpoint_id: str) -> Iterable[str]:
        return [e.chunk.hash for e in Manifest.parse(self.get_manifest(checkpoint_id)).kv_entries]
