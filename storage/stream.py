"""Live-migration wire form of a checkpoint: the same chunks and manifest, framed.

Frame = magic (4 bytes, also the frame type)
      + body length (8-byte big-endian: everything after this field)
      + header length (4-byte big-endian) + header JSON + payload.

CHUNK frames carry one stored chunk (header: its ChunkRef); the MANIFEST frame comes
last and is the commit; ABORT carries a reason. Bytes may arrive in arbitrary pieces
(HTTP bodies), so ``FrameDecoder`` is incremental, and it checks magic and lengths
before buffering a frame's body, so a hostile or corrupt stream cannot make it buffer
more than ``max_frame_bytes``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError
from relayout.storage.errors import ChunkMissing, CorruptCheckpoint, StorageError
from relayout.storage.format.chunks import new_buffer, verify_chunk
from relayout.storage.format.manifest import MAX_MANIFEST_BYTES, ChunkRef, Manifest
from relayout.storage.stores.base import Store

MAGIC_CHUNK = b"RLC1"
MAGIC_MANIFEST = b"RLM1"
MAGIC_ABORT = b"RLA1"
_KINDS = {MAGIC_CHUNK: "chunk", MAGIC_MANIFEST: "manifest", MAGIC_ABORT: "abort"}
_PREFIX = struct.Struct(">4sQ")
_HLEN = struct.Struct(">I")
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_FRAME_BYTES = 512 * 1024 * 1024


class StreamAborted(StorageError):
    """The sender ended the stream with an ABORT frame."""


class LimitExceeded(StorageError):
    """A stream sent more bytes than its receiver accepts."""


@dataclass
class Frame:
    kind: str  # "chunk" | "manifest" | "abort"
    header: dict[str, Any]
    payload: bytes  # a bytearray for chunk frames (the buffer it was received into)
    ref: ChunkRef | None = field(default=None)  # set for chunk frames
    placed: bool = False  # a chunk whose payload went into a PayloadSink (payload is empty)


class PayloadSink(Protocol):
    """Where a chunk frame's payload goes instead of a buffer of its own, as it arrives (a KV pool's
    rows: engine.moves.kv_stream). The sink hashes what it is given; `finish` refuses bytes that do not
    hash to the chunk's reference (CorruptCheckpoint), and until then nothing may use them."""

    def want(self) -> memoryview: ...  # where the payload's next bytes go (not empty while any remain)

    def got(self, n: int) -> None: ...  # `n` bytes were written at the start of the last `want()`

    def finish(self) -> None: ...  # every payload byte arrived


# (the chunk's reference, its frame's "entry": where its bytes belong) -> a sink for them, or None
Place = Callable[[ChunkRef, dict[str, Any]], PayloadSink | None]


FRAME_PREFIX_BYTES = _PREFIX.size + _HLEN.size  # magic + body length + header length


def frame_head(magic: bytes, header: dict[str, Any], payload_len: int) -> bytes:
    """Everything of a frame before its payload (the payload can then be sent without copying it)."""
    h = json.dumps(header, separators=(",", ":")).encode()
    if len(h) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {len(h)} bytes exceeds {MAX_HEADER_BYTES}")
    return b"".join((_PREFIX.pack(magic, _HLEN.size + len(h) + payload_len), _HLEN.pack(len(h)), h))


def parse_frame_prefix(prefix: bytes | bytearray, kinds: Container[bytes], max_frame_bytes: int) -> tuple[bytes, int, int]:
    """Check a frame's first FRAME_PREFIX_BYTES before anything else is read or buffered:
    (magic, header length, payload length), or CorruptCheckpoint naming what is wrong."""
    magic, body_len = _PREFIX.unpack_from(prefix)
    if magic not in kinds:
        raise CorruptCheckpoint(f"bad frame magic {magic!r}")
    if body_len > max_frame_bytes:
        raise CorruptCheckpoint(f"frame of {body_len} bytes exceeds the {max_frame_bytes}-byte limit")
    if body_len < _HLEN.size:
        raise CorruptCheckpoint(f"frame body of {body_len} bytes is too short for its header length")
    (hlen,) = _HLEN.unpack_from(prefix, _PREFIX.size)
    if hlen > min(MAX_HEADER_BYTES, body_len - _HLEN.size):
        raise CorruptCheckpoint(f"frame header length {hlen} is out of bounds (body {body_len})")
    return magic, hlen, body_len - _HLEN.size - hlen


def parse_frame_header(kind: str, hraw: bytes | bytearray) -> dict[str, Any]:
    try:
        header = json.loads(hraw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptCheckpoint(f"{kind} frame header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"{kind} frame header must be a JSON object")
    return header


def _encode(magic: bytes, header: dict[str, Any], payload: bytes) -> bytes:
    return frame_head(magic, header, len(payload)) + payload


def chunk_frame_header(ref: ChunkRef, entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """A CHUNK frame's header: its reference, and optionally its `entry` (what KV it is: session,
    layer, heads, tokens, the session's KV tokens, dtype), so that a receiver may write its payload
    where it belongs as it arrives. A receiver that does not place chunks ignores the entry."""
    h = ref.model_dump()
    if entry is not None:
        h["entry"] = entry
    return h


def encode_chunk_frame(ref: ChunkRef, data: bytes) -> bytes:
    if len(data) != ref.size:
        raise ValueError(f"chunk {ref.hash}: {len(data)} bytes but ref says {ref.size}")
    return _encode(MAGIC_CHUNK, ref.model_dump(), data)


def encode_manifest_frame(manifest: Manifest, raw: bytes | None = None) -> bytes:
    """MANIFEST frame; pass ``raw`` (the stored manifest bytes) to forward them unchanged."""
    return encode_raw_manifest_frame(manifest.checkpoint_id, raw if raw is not None else manifest.to_bytes())


def encode_raw_manifest_frame(checkpoint_id: str, raw: bytes) -> bytes:
    """MANIFEST frame of manifest bytes already serialised (and validated) by their writer."""
    return _encode(MAGIC_MANIFEST, {"checkpoint_id": checkpoint_id}, raw)


def encode_abort_frame(reason: str) -> bytes:
    return _encode(MAGIC_ABORT, {"reason": reason[:4096]}, b"")


class FrameDecoder:
    """Incremental frame parser; ``feed`` returns the frames completed by each piece.

    Each byte is copied once: a frame's prefix and header gather in a small buffer, its payload
    goes straight into a buffer of the declared size (allocated once the prefix has been checked),
    or, for a chunk that `place` finds a sink for, straight where it belongs (PayloadSink)."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, place: Place | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.place = place
        self._buf = bytearray()  # the current frame's prefix + header
        self._payload: bytearray | None = None  # set once the header is complete
        self._sink: PayloadSink | None = None  # ...or this takes the payload
        self._ref: ChunkRef | None = None  # a placed chunk's reference
        self._got = 0
        self._magic = b""
        self._hlen = self._plen = 0
        self._hraw = b""
        self._error: CorruptCheckpoint | None = None
        self._scratch = bytearray(FRAME_PREFIX_BYTES)  # read-into mode: a prefix or header lands here

    @property
    def at_boundary(self) -> bool:
        """True when no partial frame is buffered (a clean place for the stream to end)."""
        return not self._buf and self._payload is None and self._sink is None

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._error is not None:
            raise self._error  # a broken stream stays broken: framing cannot resynchronise
        mv = memoryview(data).cast("B")
        frames: list[Frame] = []
        try:
            while True:
                if self._sink is not None:
                    while mv and self._sink is not None:
                        view = self._sink.want()
                        n = min(len(view), len(mv), self._plen - self._got)
                        view[:n] = mv[:n]
                        mv = mv[n:]
                        frames += self._sunk(n)
                    if self._sink is not None:
                        return frames
                    continue
                if self._payload is None:
                    mv = self._head(mv)
                    if self._payload is None and self._sink is None:
                        return frames
                    if self._sink is not None:
                        continue
                payload = self._payload
                assert payload is not None
                if self._got < len(payload):
                    if not mv:
                        return frames
                    n = min(len(mv), len(payload) - self._got)
                    payload[self._got : self._got + n] = mv[:n]
                    self._got += n
                    mv = mv[n:]
                    if self._got < len(payload):
                        return frames
                self._payload = None
                frames.append(self._build(_KINDS[self._magic], self._hraw, payload))
        except CorruptCheckpoint as exc:
            self._error = exc
            self._buf, self._payload, self._sink = bytearray(), None, None
            raise

    def want(self) -> memoryview:
        """Where the next bytes of the stream go (read-into mode, for a reader that fills buffers
        itself, e.g. `socket.recv_into`): the rest of the current frame's payload, written in place
        (no copy), or a small scratch buffer for the next field of its prefix or header. Fill some
        of it, then call `got(n)`. Never more than the current frame's declared bytes."""
        if self._error is not None:
            raise self._error
        if self._sink is not None:
            return self._sink.want()[: self._plen - self._got]
        if self._payload is not None:
            return memoryview(self._payload)[self._got :]
        # the whole prefix in one read (_head still checks its fields one by one): a read of each
        # field cost a chunk three more trips through the reader (~1/15 of a placing receiver's CPU)
        end = FRAME_PREFIX_BYTES if len(self._buf) < FRAME_PREFIX_BYTES else FRAME_PREFIX_BYTES + self._hlen
        need = end - len(self._buf)
        if len(self._scratch) < need:
            self._scratch = bytearray(need)
        return memoryview(self._scratch)[:need]

    def got(self, n: int) -> list[Frame]:
        """`n` bytes were written into the view `want()` returned: the frames they complete."""
        try:
            if self._sink is not None:
                return self._sunk(n)
        except CorruptCheckpoint as exc:
            self._error, self._sink = exc, None
            raise
        if self._payload is None:
            return self.feed(memoryview(self._scratch)[:n])
        self._got += n
        if self._got < len(self._payload):
            return []
        payload, self._payload = self._payload, None
        try:
            return [self._build(_KINDS[self._magic], self._hraw, payload)]
        except CorruptCheckpoint as exc:
            self._error = exc
            raise

    def _sunk(self, n: int) -> list[Frame]:
        """`n` more payload bytes are in the sink: the placed chunk's frame once they are all there."""
        sink = self._sink
        assert sink is not None and self._ref is not None
        sink.got(n)
        self._got += n
        if self._got < self._plen:
            return []
        self._sink = None
        sink.finish()  # the hash, before anyone is told the chunk arrived
        return [Frame(kind="chunk", header=self._ref.model_dump(), payload=b"", ref=self._ref, placed=True)]

    def _head(self, mv: memoryview) -> memoryview:
        """Take from `mv` the bytes of the current frame's prefix and header (checking each field as
        soon as it is complete); once complete, allocate its payload buffer (or find its sink).
        Returns the rest of `mv`."""
        buf = self._buf
        while mv:
            # the magic, then the body length are checked as soon as they arrive, before the rest is awaited
            marks = (4, _PREFIX.size, FRAME_PREFIX_BYTES)
            need = next((m for m in marks if len(buf) < m), FRAME_PREFIX_BYTES + self._hlen)
            take = min(len(mv), need - len(buf))
            buf += mv[:take]
            mv = mv[take:]
            if len(buf) == 4 and bytes(buf) not in _KINDS:
                raise CorruptCheckpoint(f"bad frame magic {bytes(buf[:4])!r}")
            if len(buf) == _PREFIX.size:
                _, body_len = _PREFIX.unpack_from(buf)
                if body_len > self.max_frame_bytes:
                    raise CorruptCheckpoint(f"frame of {body_len} bytes exceeds the {self.max_frame_bytes}-byte limit")
            if len(buf) == FRAME_PREFIX_BYTES:
                self._magic, self._hlen, self._plen = parse_frame_prefix(buf, _KINDS, self.max_frame_bytes)
            if len(buf) >= FRAME_PREFIX_BYTES and len(buf) == FRAME_PREFIX_BYTES + self._hlen:
                self._hraw = bytes(buf[FRAME_PREFIX_BYTES:])
                self._buf, self._got = bytearray(), 0
                if self.place is not None and self._magic == MAGIC_CHUNK and self._plen:
                    header = parse_frame_header("chunk", self._hraw)
                    entry = header.pop("entry", None)
                    self._ref = _chunk_ref(header, self._plen)
                    if isinstance(entry, dict):
                        self._sink = self.place(self._ref, entry)
                if self._sink is None:
                    self._payload = new_buffer(self._plen)  # every byte is written before use
                return mv
        return mv

    def close(self) -> None:
        """Declare end of input; a partial frame left over is a truncated stream."""
        if not self.at_boundary:
            held = self._payload is not None or self._sink is not None
            n = len(self._buf) + (FRAME_PREFIX_BYTES + len(self._hraw) + self._got if held else 0)
            raise CorruptCheckpoint(f"stream truncated inside a frame ({n} bytes buffered)")

    @staticmethod
    def _build(kind: str, hraw: bytes, payload: bytearray) -> Frame:
        header = parse_frame_header(kind, hraw)
        ref = None
        if kind == "chunk":
            header.pop("entry", None)  # where it belongs: only a placing receiver reads it
            ref = _chunk_ref(header, len(payload))
            # a chunk's payload stays the buffer it was received into: stores keep it without a copy
            return Frame(kind=kind, header=header, payload=payload, ref=ref)  # type: ignore[arg-type]
        elif kind == "manifest" and len(payload) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpoint(f"manifest frame of {len(payload)} bytes exceeds {MAX_MANIFEST_BYTES}")
        return Frame(kind=kind, header=header, payload=bytes(payload), ref=ref)


def _chunk_ref(header: dict[str, Any], payload_len: int) -> ChunkRef:
    try:
        ref = ChunkRef.model_validate(header)
    except ValidationError as exc:
        raise CorruptCheckpoint(f"chunk frame header is not a valid chunk reference: {exc.error_count()} errors") from None
    if ref.size != payload_len:
        raise CorruptCheckpoint(f"chunk {ref.hash}: frame carries {payload_len} bytes, header says {ref.size}")
    return ref


class StreamReceiver:
    """Feeds a framed stream into a Store; returns the Manifest once it is committed.

    Every chunk is hash-checked on receipt (once: the store is told so, and keeps the buffer it
    was received into); the manifest is committed only after every chunk it references is
    present (received now, or already held from a pre-copy round). `place`: chunks it finds a sink
    for (FrameDecoder) are not stored: their sink holds them, hash-checked. `verify=False`: chunks are
    only size-checked here and the store takes them as unverified (`put_unverified`): their
    reader hashes them as it copies them (a live round's import: the bytes are read once).
    """

    def __init__(self, store: Store, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, verify: bool = True,
                 place: Place | None = None) -> None:
        self.store, self.verify = store, verify
        self.decoder = FrameDecoder(max_frame_bytes, place)
        self.manifest: Manifest | None = None
        self.bytes_received = 0
        self.chunks_received = 0
        self.chunks_placed = 0  # of which written where they belong as they arrived (`place`)
        self._received: set[str] = set()
        self._pinned: list[str] = []

    def feed(self, data: bytes) -> Manifest | None:
        self.bytes_received += len(data)
        try:
            self._take(self.decoder.feed(data))
        except BaseException:
            self._release()
            raise
        return self.manifest

    def _take(self, frames: list[Frame]) -> None:
        for frame in frames:
            if self.manifest is not None:
                raise CorruptCheckpoint("frame received after the manifest")
            self._handle(frame)

    def receive_from(self, read_into: Callable[[memoryview], int], limit: int | None = None) -> Manifest:
        """Read frames until the manifest commits them, each byte written once, straight into the
        buffer it is kept in (`read_into(view)` fills part of `view` and says how much, 0 at the end
        of input, like `socket.recv_into`). `limit`: more bytes than that is ImportTooLarge's cue,
        raised as `LimitExceeded`; an end of input before the manifest is a truncated stream."""
        try:
            while self.manifest is None:
                view = self.decoder.want()
                if limit is not None and self.bytes_received + len(view) > limit:
                    raise LimitExceeded(f"the stream sent more than the {limit}-byte limit")
                n = read_into(view)
                if not n:
                    return self.close()
                self.bytes_received += n
                self._take(self.decoder.got(n))
        except BaseException:
            self._release()
            raise
        return self.manifest

    def close(self) -> Manifest:
        """End of input: the committed manifest, or an error if the stream stopped short."""
        self.decoder.close()
        if self.manifest is None:
            self._release()
            raise CorruptCheckpoint("stream ended before its manifest: nothing was committed")
        return self.manifest

    def _handle(self, frame: Frame) -> None:
        if frame.kind == "abort":
            raise StreamAborted(f"sender aborted the stream: {frame.header.get('reason', '')!s:.4096}")
        if frame.kind == "chunk":
            if frame.ref is None:  # the decoder always sets it; keep the invariant explicit
                raise CorruptCheckpoint("chunk frame without a chunk reference")
            if frame.placed:  # its bytes are where they belong, hash-checked by their sink
                self._received.add(frame.ref.hash)
                self.chunks_received += 1
                self.chunks_placed += 1
                return
            verify_chunk(frame.payload, frame.ref, hashed=not self.verify)  # the hash, or (unverified) the size
            self.store.pin(frame.ref.hash)
            self._pinned.append(frame.ref.hash)
            if self.verify:
                self.store.put_chunk(frame.ref.hash, frame.payload, hashed=True)  # verified just above
            else:
                self.store.put_unverified(frame.ref.hash, frame.payload)
            self._received.add(frame.ref.hash)
            self.chunks_received += 1
            return
        manifest = Manifest.parse(frame.payload)
        for e in manifest.kv_entries:
            h = e.chunk.hash
            if h not in self._received and not self.store.has_chunk(h):
                raise ChunkMissing(
                    f"manifest {manifest.checkpoint_id} references chunk {h} (session {e.session_id}, "
                    f"layer {e.layer}) that the stream did not carry"
                )
        gap = manifest.coverage_error(from_kv_from=True)  # a delta round: its receiver checks the rest
        if gap is not None:
            raise CorruptCheckpoint(f"streamed checkpoint {manifest.checkpoint_id} is incomplete: {gap}")
        self.store.put_manifest(manifest.checkpoint_id, frame.payload)
        self.manifest = manifest
        self._release()

    def _release(self) -> None:
        self.store.unpin(self._pinned)
        self._pinned = []


def iter_checkpoint_frames(store: Store, checkpoint_id: str, skip: Container[str] = ()) -> Iterator[bytes]:
    """Frames of a stored checkpoint: each distinct chunk (minus ``skip``), then the manifest."""
    raw = store.get_manifest(checkpoint_id)
    manifest = Manifest.parse(raw)
    sent: set[str] = set()
    for e in manifest.kv_entries:
        h = e.chunk.hash
        if h in sent or h in skip:
            continue
        sent.add(h)
        yield encode_chunk_frame(e.chunk, store.get_chunk(h))
    yield encode_manifest_frame(manifest, raw)
