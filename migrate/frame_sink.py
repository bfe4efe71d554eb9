"""The export side of a live round: a Store whose writes become stream frames, so the plain
CheckpointWriter (with all its checks) writes a round exactly as it writes a checkpoint."""

from __future__ import annotations

import threading

import zstandard
from relayout.storage.manifest import ChunkRef
from relayout.storage.store_base import Store, check_hash
from relayout.storage.stream import encode_chunk_frame, encode_raw_manifest_frame


def raw_size(codec: str, data: bytes) -> int:
    """A stored chunk's decoded size: the bytes themselves for "none"; the zstd frame's content
    size otherwise (our encoder always writes it)."""
    if codec == "none":
        return memoryview(data).nbytes
    n = zstandard.frame_content_size(data)
    if n < 0:
        raise ValueError("zstd chunk without a content size")
    return n


class FrameSink(Store):
    """A Store whose writes become stream frames (nothing is kept): a CheckpointWriter writing
    into it produces a live round. Chunks in `sent` (earlier rounds) are not sent again."""

    identity = "frame-sink"

    def __init__(self, sent: set[str], codec: str):
        self.sent, self.codec = sent, codec
        self._lock = threading.Lock()  # the writer puts chunks from several threads
        self._frames: list[bytes] = []

    def has_chunk(self, h: str) -> bool:
        return h in self.sent

    def put_chunk(self, h: str, data: bytes, *, hashed: bool = False) -> None:
        check_hash(h)
        ref = ChunkRef(hash=h, size=memoryview(data).nbytes, raw_size=raw_size(self.codec, data),
                       codec=self.codec)  # type: ignore[arg-type]
        with self._lock:
            if h in self.sent:
                return
            self.sent.add(h)
        frame = encode_chunk_frame(ref, data)
        with self._lock:
            self._frames.append(frame)

    def put_manifest(self, checkpoint_id: str, data: bytes) -> None:
        # the writer just built and validated these bytes: no need to parse them again
        with self._lock:
            self._frames.append(encode_raw_manifest_frame(checkpoint_id, data))

    def pin(self, h: str) -> None:
        pass

    def unpin(self, hashes) -> None:
        pass

    def take(self) -> list[bytes]:
        with self._lock:
            out, self._frames = self._frames, []
        return out
