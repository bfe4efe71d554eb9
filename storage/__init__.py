"""relayout storage: the layout-independent checkpoint format, codecs, stores and stream framing.

Engine-agnostic: nothing here imports engine/, agent/ or migrate/; torch is used only as
a tensor type.
"""

from storage.checkpoint import CheckpointReader, CheckpointWriter
from storage.chunks import chunk_hash, pack_kv, unpack_kv
from storage.codecs import CODECS, decode, encode, measure_codecs
from storage.errors import CheckpointNotFound, ChunkMissing, CorruptCheckpoint, ModelMismatch, StorageError
from storage.manifest import ChunkRef, KVEntry, KVGeometry, Manifest, ModelRef, SessionEntry
from storage.stores import LocalStore, MemoryStore, S3Store, Store, open_store
from storage.stream import (
    FrameDecoder,
    StreamAborted,
    StreamReceiver,
    encode_abort_frame,
    encode_chunk_frame,
    encode_manifest_frame,
    iter_checkpoint_frames,
)

__all__ = [
    "CODECS", "CheckpointNotFound", "CheckpointReader", "CheckpointWriter", "ChunkMissing", "ChunkRef",
    "CorruptCheckpoint", "FrameDecoder", "KVEntry", "KVGeometry", "LocalStore", "Manifest", "MemoryStore",
    "ModelMismatch", "ModelRef", "S3Store", "SessionEntry", "StorageError", "Store", "StreamAborted",
    "StreamReceiver", "chunk_hash", "decode", "encode", "encode_abort_frame", "encode_chunk_frame",
    "encode_manifest_frame", "iter_checkpoint_frames", "measure_codecs", "open_store", "pack_kv", "unpack_kv",
]
