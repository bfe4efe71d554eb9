"""Storage error hierarchy.

Every failure the storage layer reports on purpose is a ``StorageError`` subclass, so
callers (agent, migrate) can map them to clear 4xx/5xx answers without catching
unrelated exceptions. Messages always name the cause: which chunk, session or layer.
"""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every storage-layer error."""


class CorruptCheckpoint(StorageError):
    """Bytes that fail a hash, size, schema or framing check."""


class ChunkMissing(StorageError):
    """A manifest (or caller) references a chunk the store does not hold."""


class CheckpointNotFound(StorageError):
    """No committed manifest under that checkpoint id."""


class ModelMismatch(StorageError):
    """The checkpoint was taken from a different model than the restore target."""
