"""relayout storage: the layout-independent checkpoint format, codecs, stores and stream framing.

Engine-agnostic: nothing here imports engine/, agent/ or migrate/; torch is used only as
a tensor type.

The names below are loaded on first use (PEP 562 `__getattr__`), not when the package is: importing
a light submodule such as `relayout.storage.settings` (the CLI does, for every command) must not
pull torch, safetensors or boto3 in through this file.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the submodule that defines it (import from the submodule itself where a type checker should see it)
_EXPORTS = {
    **dict.fromkeys(("CheckpointReader", "CheckpointWriter"), "checkpoint"),
    **dict.fromkeys(("chunk_hash", "pack_kv", "unpack_kv"), "format.chunks"),
    **dict.fromkeys(("CODECS", "decode", "encode", "measure_codecs"), "format.codecs"),
    **dict.fromkeys(("CheckpointNotFound", "ChunkMissing", "CorruptCheckpoint", "ModelMismatch", "StorageError"),
                    "errors"),
    **dict.fromkeys(("ChunkRef", "KVEntry", "KVGeometry", "Manifest", "ModelRef", "SessionEntry"), "format.manifest"),
    **dict.fromkeys(("LocalStore", "MemoryStore", "S3Store", "Store", "open_store"), "stores"),
    **dict.fromkeys(("FrameDecoder", "StreamAborted", "StreamReceiver", "encode_abort_frame", "encode_chunk_frame",
                     "encode_manifest_frame", "iter_checkpoint_frames"), "stream"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
