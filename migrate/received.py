"""What a target holds of an incoming transfer between its rounds: the chunks received (each
verified on receipt), until their KV is in the pool."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from relayout.migrate.transport import in_thread
from relayout.storage.chunks import keep_freed_memory
from relayout.storage.manifest import ChunkRef, Manifest
from relayout.storage.store_base import check_hash
from relayout.storage.stores import MemoryStore
from relayout.storage.stream import LimitExceeded, StreamReceiver

ReadInto = Callable[[memoryview], int]  # fills part of a buffer from the link, says how much (a RoundCut at its end)


class RoundLease(Protocol):
    """What a round's bytes update on the incoming transfer (migrate.transfers.Incoming)."""

    staged: int  # bytes received by all its rounds
    last: float  # its lease: the clock time of the last sign of life


async def receive_round_bytes(i: RoundLease, recv: StreamReceiver, pieces: AsyncIterator[bytes] | ReadInto, limit: int,
                              clock: Callable[[], float], background: bool = False) -> Manifest:
    """One round's frames into `recv` until its manifest, from either kind of transport: byte pieces
    as they arrive (an HTTP body), or a `read_into(view) -> n` that fills buffers itself (the frame
    link's socket: read on a thread, each chunk straight into the buffer it is kept in). Every byte
    counts against `limit` (LimitExceeded) and renews the transfer's lease. `background` (a pre-copy
    round): the reading thread is a pre-copy worker (migrate.transport.background_thread)."""
    if callable(pieces):
        read = pieces

        def read_into(view: memoryview) -> int:
            n = read(view)
            i.staged += n
            i.last = clock()  # a round still arriving is not an idle transfer
            return n

        return await in_thread(recv.receive_from, read_into, limit - i.staged, background=background)
    async for piece in pieces:
        if piece:
            i.staged += len(piece)
            i.last = clock()
            if i.staged > limit:
                raise LimitExceeded(f"the stream sent more than the {limit}-byte limit")
            recv.feed(piece)
    return recv.close()


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

    def has_chunk(self, h: str) -> bool:
        return super().has_chunk(h) or check_hash(h) in self._imported

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
        for h in done - needed:
            self._imported.add(h)
            self._delete_chunk(h)
