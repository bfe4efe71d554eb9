"""The export side of a live round: a Store whose writes become stream frames, so the plain
CheckpointWriter (with all its checks) writes a round exactly as it writes a checkpoint."""

from __future__ import annotations

import threading

from relayout.storage.manifest import ChunkRef
from relayout.storage.store_base import Store, check_hash
from relayout.storage.stream import MAGIC_CHUNK, encode_raw_manifest_frame, frame_head


class FrameSink(Store):
    """A Store whose writes become stream frames (nothing is kept): a CheckpointWriter writing
    into it produces a live round. Chunks in `sent` (earlier rounds) are not sent again. A chunk
    frame is handed on as two pieces, its head and the chunk buffer itself (never joined: that
    would copy every byte), so `take` returns byte pieces (bytes, memoryviews) whose concatenation is the frames."""

    identity = "frame-sink"

    def __init__(self, sent: set[str]):
        self.sent = sent
        self._lock = threading.Lock()  # the writer puts chunks from several threads
        self._frames: list[bytes | memoryview] = []

    def has_chunk(self, h: str) -> bool:
        return h in self.sent

    def put_chunk(self, h: str, data: bytes, *, hashed: bool = False, ref: ChunkRef | None = None) -> None:
        check_hash(h)
        if ref is None or ref.hash != h:
            # a frame names the chunk's decoded size and codec: only the writer knows them
            raise ValueError(f"chunk {h}: a frame sink needs the chunk's reference (CheckpointWriter passes it)")
        with self._lock:
            if h in self.sent:
                return
            self.sent.add(h)
        if len(data) != ref.size:
            raise ValueError(f"chunk {h}: {len(data)} bytes but ref says {ref.size}")
        head = frame_head(MAGIC_CHUNK, ref.model_dump(), len(data))
        with self._lock:
            self._frames += (head, memoryview(data))  # bytes-like for every server and transport

    def put_manifest(self, checkpoint_id: str, data: bytes) -> None:
        # the writer just built and validated these bytes: no need to parse them again
        with self._lock:
            self._frames.append(encode_raw_manifest_frame(checkpoint_id, data))

    def pin(self, h: str) -> None:
        pass

    def unpin(self, hashes) -> None:
        pass

    def take(self) -> list[bytes | memoryview]:
        with self._lock:
            out, self._frames = self._frames, []
        return out
