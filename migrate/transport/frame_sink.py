"""The export side of a live round: a Store whose writes become stream frames, so the plain
CheckpointWriter (with all its checks) writes a round exactly as it writes a checkpoint."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from relayout.storage.format.chunks import ChunkPieces
from relayout.storage.format.manifest import ChunkRef, KVEntry
from relayout.storage.stores.base import Store, check_hash
from relayout.storage.stream import (
    MAGIC_CHUNK,
    chunk_frame_header,
    encode_raw_manifest_frame,
    frame_head,
)


@dataclass
class FrameOptions:
    """How a round's frames are written, decided by whoever sends them before the first is made.
    `entries`: each chunk frame names its entry (storage.stream.chunk_frame_header), so a target
    that places chunks writes each into its pool as it arrives (the frame link, to a target that
    says it does: migrate.transport.frame_link)."""

    entries: bool = False


class FrameSink(Store):
    """A Store whose writes become stream frames (nothing is kept): a CheckpointWriter writing
    into it produces a live round. Chunks in `sent` (earlier rounds) are not sent again. A chunk
    frame is handed on as two pieces, its head and the chunk buffer itself (never joined: that
    would copy every byte), so `take` returns byte pieces (bytes, memoryviews) whose concatenation is the frames."""

    identity = "frame-sink"
    takes_pieces = True  # an in-place chunk (storage.format.pieces) goes out as its pieces, never joined

    def __init__(self, sent: set[str], options: FrameOptions | None = None):
        self.sent = sent
        self.held = set(sent)  # what the target holds from before this round
        self.options = options or FrameOptions()
        # session -> its KV tokens in this round, named in entries: what a 0.6 target reserves from (a
        # 0.7 one reserves from the round's header, in the link's hello)
        self.kv_tokens: dict[str, int] = {}
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
        self._append(ref, data)

    def put_kv_chunk(self, entry: KVEntry, data: bytes | ChunkPieces, dtype: str) -> None:
        """CheckpointWriter.put_kv's chunk, with the entry it was written for: framed with that entry
        (FrameOptions.entries), where a target places it, so every entry's chunk is sent even if
        another entry of this round has the same bytes (a placed chunk's bytes are not kept)."""
        ref = entry.chunk
        if not self.options.entries:
            return self.put_chunk(ref.hash, data, hashed=True, ref=ref)  # type: ignore[arg-type]
        if ref.hash not in self.held:
            self._append(ref, data, {**entry.model_dump(exclude={"chunk"}), "dtype": dtype,
                                     "kv_tokens": self.kv_tokens.get(entry.session_id)})

    def _append(self, ref: ChunkRef, data: bytes | ChunkPieces, entry: dict | None = None) -> None:
        """The chunk's frame, as its head and the chunk's own buffers (bytes-like for every server and transport)."""
        if len(data) != ref.size:
            raise ValueError(f"chunk {ref.hash}: {len(data)} bytes but ref says {ref.size}")
        head = frame_head(MAGIC_CHUNK, chunk_frame_header(ref, entry), len(data))
        body = data.views if isinstance(data, ChunkPieces) else (memoryview(data),)
        with self._lock:
            self.sent.add(ref.hash)
            self._frames += (head, *body)

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
