"""relayout storage: the layout-independent checkpoint format, codecs, stores and stream framing.

Engine-agnostic: nothing here imports engine/, agent/ or migrate/; torch is used only as
a tensor type.
"""

from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.chunks import chunk_hash, pack_kv, unpack_kv
from relayout.storage.codecs import CODECS, decode, encode, measure_codecs
from relayout.storage.errors import (
    CheckpointNotFound,
    ChunkMissing,
    CorruptCheckpoint,
    ModelMismatch,
    StorageError,
)
from relayout.storage.manifest import ChunkRef, KVEntry, KVGeometry, Manifest, ModelRef, SessionEntry
from relayout.storage.stores import LocalStore, MemoryStore, S3Store, Store, open_store
from relayout.storage.stream import (
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
