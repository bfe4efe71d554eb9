"""What a target holds of an incoming transfer between its rounds: the chunks received (each
verified on receipt), until their KV is in the pool."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from relayout.engine.moves.kv_stream import Placed
from relayout.migrate.transport.base import RoundCut, on_worker
from relayout.storage.errors import ChunkMissing
from relayout.storage.format.chunks import chunk_hash, keep_freed_memory
from relayout.storage.format.manifest import ChunkRef, Manifest
from relayout.storage.stores import MemoryStore
from relayout.storage.stores.base import check_hash
from relayout.storage.stream import LimitExceeded, StreamReceiver

ReadInto = Callable[[memoryview], int]  # fills part of a buffer from the link, says how much (a RoundCut at its end)


class RoundLease(Protocol):
    """What a round's bytes update on the incoming transfer (migrate.protocol.transfers.Incoming)."""

    staged: int  # bytes received by all its rounds
    last: float  # its lease: the clock time of the last sign of life
    closed: bool  # dropped: a round still arriving stops at its next read


def read_round_bytes(i: RoundLease, recv: StreamReceiver, read: ReadInto, limit: int,
                     clock: Callable[[], float]) -> Manifest:
    """One round's frames into `recv` until its manifest, read by this thread with `read(view) -> n`
    (the frame link's socket: each chunk straight into the buffer, or the pool rows, it is kept in).
    Every byte counts against `limit` (LimitExceeded) and renews the transfer's lease."""
    def read_into(view: memoryview) -> int:
        if i.closed:  # (its blocks stay reserved until this round ends: migrate.protocol.transfers.drop_incoming)
            raise RoundCut()
        n = read(view)
        i.staged += n
        i.last = clock()  # a round still arriving is not an idle transfer
        return n

    try:
        return recv.receive_from(read_into, limit - i.staged)
    except RoundCut:
        _verify_kept(recv)
        raise


async def receive_round_bytes(i: RoundLease, recv: StreamReceiver, pieces: AsyncIterator[bytes], limit: int,
                              clock: Callable[[], float]) -> Manifest:
    """One round's frames into `recv` until its manifest, from byte pieces as they arrive (an HTTP
    body, a Mooncake ring). Every byte counts against `limit` (LimitExceeded) and renews the
    transfer's lease."""
    try:
        async for piece in pieces:
            if piece:
                i.staged += len(piece)
                i.last = clock()
                if i.staged > limit:
                    raise LimitExceeded(f"the stream sent more than the {limit}-byte limit")
                recv.feed(piece)
    except RoundCut:
        await on_worker(_verify_kept, recv)
        raise
    return recv.close()


def _verify_kept(recv: StreamReceiver) -> None:
    """A cut round's chunks are kept for its resume, which will not resend them: hash the ones its
    import would have (received unverified) now, and drop any that do not match."""
    if isinstance(recv.store, ReceivedChunks):
        recv.store.verify_pending()


class ReceivedChunks(MemoryStore):
    """A MemoryStore that lets go of a chunk's bytes once every token it carries is imported into
    the pool (`forget_imported`), keeping its hash: the transfer still holds that chunk (a later
    round's manifest lists it, a resumed round does not resend it), the bytes are just not needed
    again, since each round imports only the tokens after those already imported. So a transfer
    stages about one round, not the whole KV, and the next round reuses that memory.
    `chunk_hashes` (MemoryStore's) lists only chunks whose bytes are held: a resumed round resends the others."""

    def __init__(self) -> None:
        super().__init__()
        self._imported: set[str] = set()
        # received, not hashed yet (StreamReceiver(verify=False)): the import hashes each as it copies
        # it (engine.moves.kv_import), so its bytes are read once; a cut round's are hashed on the cut
        self._pending: set[str] = set()
        self.placed: Placed = {}  # chunks written into the pool as they arrived (engine.moves.kv_stream)

    def has_chunk(self, h: str) -> bool:
        return super().has_chunk(h) or check_hash(h) in self._imported

    def put_unverified(self, h: str, data: bytes) -> None:
        held = super().has_chunk(h)  # bytes already here (verified or not): these are not kept
        self.put_chunk(h, data, hashed=True)
        if not held:
            with self._lock:
                self._pending.add(h)

    def unverified(self, h: str) -> bool:
        with self._lock:
            return h in self._pending

    def mark_verified(self, h: str) -> None:
        with self._lock:
            self._pending.discard(h)

    def verify_pending(self) -> None:
        """Hash every chunk held unverified; drop those whose bytes do not match their hash."""
        with self._lock:
            pending, self._pending = set(self._pending), set()
        for h in pending:
            try:
                data = self.get_chunk(h)
            except ChunkMissing:
                continue
            if chunk_hash(data) != h:
                self._delete_chunk(h)

    def chunk_hashes(self) -> list[str]:
        """The chunks whose bytes are held and verified: what a resumed round need not resend."""
        with self._lock:
            return [h for h in self._chunks if h not in self._pending]

    def put_chunk(self, h: str, data: bytes, *, hashed: bool = False, ref: ChunkRef | None = None) -> None:
        # the same bytes again (another session's identical chunk in a later round): hold them anew,
        # or their import would find only the hash
        imported = check_hash(h) in self._imported and not super().has_chunk(h)
        self._imported.discard(h)
        try:
            super().put_chunk(h, data, hashed=hashed, ref=ref)
        except BaseException:
            if imported:
                self._imported.add(h)
            raise

    def forget_imported(self, manifest: Manifest, upto: dict[str, int], round_bytes: int) -> None:
        """Drop the bytes of chunks all of whose entries lie below their session's imported tokens."""
        # the buffers freed below stay with this process's malloc for the next round (no page
        # faults anew): raised first, since malloc trims at the free that crosses its threshold
        keep_freed_memory(round_bytes)
        done, needed = set(), set()
        for e in manifest.kv_entries:
            (done if e.tok_hi <= upto.get(e.session_id, 0) else needed).add(e.chunk.hash)
        for key in [k for k in self.placed if k[5] <= upto.get(k[0], 0)]:  # imported: not looked up again
            del self.placed[key]
        for h in done - needed:
            self._imported.add(h)
            self._delete_chunk(h)
            self.mark_verified(h)
