"""Writing and reading checkpoints: chunks first, manifest last (the commit).

Writers may slice KV however the source layout holds it (any head ranges, any token
ranges); readers ask for the head range their own layout needs and get it assembled
from whichever entries overlap, with every chunk hash verified.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
from relayout.storage.errors import CorruptCheckpoint, ModelMismatch
from relayout.storage.format.chunks import (
    ChunkPieces,
    KVChunk,
    dtype_name,
    kv_scaled_view,
    kv_view,
    pack_kv,
    parallel_map,
)
from relayout.storage.format.manifest import (
    KVEntry,
    KVGeometry,
    Manifest,
    ModelRef,
    SessionEntry,
    coverage_gap,
)
from relayout.storage.stores.base import Store, check_id

ProgressFn = Callable[[int], None]  # called with the cumulative bytes written


class CheckpointWriter:
    """Collects KV chunks and session states, then commits a manifest.

    ``put_kv`` is thread-safe, so a source may write layers/ranks concurrently. Until
    ``commit`` the checkpoint is invisible; ``abort`` (or leaving a ``with`` block by an
    exception) leaves only unreferenced chunks, which ``cleanup_incomplete`` removes.
    """

    def __init__(
        self,
        store: Store,
        checkpoint_id: str,
        codec: str = "none",
        progress: ProgressFn | None = None,
        kv_from: dict[str, int] | None = None,
        state_from: dict[str, dict[str, int]] | None = None,
    ) -> None:
        """`kv_from` (session -> token): write one delta round of a protection stream, each such
        session's KV listed from that token on (SessionEntry.kv_from); never a checkpoint.
        `state_from` (session -> list field -> items the receiver holds): its states' lists too, each
        from that index on where the list is at least that long (SessionEntry.state_from)."""
        self.store = store
        self.checkpoint_id = check_id(checkpoint_id)
        self.codec = codec
        self.progress = progress
        self.bytes_written = 0  # stored (encoded) bytes of every chunk put, shared or new
        self.raw_bytes = 0  # tensor payload bytes before the codec
        self._lock = threading.Lock()
        self._entries: list[KVEntry] = []
        self._sessions: dict[str, SessionEntry] = {}
        self._pinned: list[str] = []
        self._dtype: torch.dtype | None = None
        self._head_dim: int | None = None
        self._scaled = False
        self._closed = False
        self._kv_from = dict(kv_from or {})
        self._state_from = dict(state_from or {})

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._closed:
            self.abort()

    def put_kv(
        self,
        session_id: str,
        layer: int,
        head_lo: int,
        head_hi: int,
        tok_lo: int,
        tok_hi: int,
        chunk: torch.Tensor | KVChunk,
        scale: torch.Tensor | None = None,
    ) -> KVEntry:
        """Store K and V ([2, head_hi-head_lo, tok_hi-tok_lo, head_dim]) for one slice, as a tensor or
        a KVChunk already laid out (stored as it is); `scale`: the float32 [2, heads, tokens] scales of
        quantised (fp8) KV (every chunk has them, or none)."""
        tensor = chunk.view if isinstance(chunk, KVChunk) else chunk
        want = (2, head_hi - head_lo, tok_hi - tok_lo)
        if tensor.dim() != 4 or tuple(tensor.shape[:3]) != want:
            raise ValueError(
                f"session {session_id} layer {layer}: tensor shape {list(tensor.shape)} does not match "
                f"[2, {want[1]}, {want[2]}, head_dim] for heads [{head_lo},{head_hi}) tokens [{tok_lo},{tok_hi})"
            )
        self._check_open()
        # outside the lock: the expensive part (a sealed or in-place chunk was hashed already)
        data, ref = pack_kv(chunk, self.codec, scale)
        if isinstance(data, ChunkPieces) and not self.store.takes_pieces:
            data = data.joined()  # a store that keeps bytes gets them in one buffer
        entry = KVEntry(
            session_id=session_id, layer=layer, head_lo=head_lo, head_hi=head_hi,
            tok_lo=tok_lo, tok_hi=tok_hi, chunk=ref,
        )
        with self._lock:
            if self._dtype is None:
                self._dtype, self._head_dim, self._scaled = tensor.dtype, int(tensor.shape[3]), scale is not None
            elif (tensor.dtype, int(tensor.shape[3]), scale is not None) != (self._dtype, self._head_dim, self._scaled):
                raise ValueError(
                    f"session {session_id} layer {layer}: {dtype_name(tensor.dtype)}×{tensor.shape[3]} "
                    f"({'with' if scale is not None else 'without'} scales) differs from earlier chunks "
                    f"({dtype_name(self._dtype)}×{self._head_dim}, {'with' if self._scaled else 'without'} scales)"
                )
            self.store.pin(ref.hash)  # before put: a concurrent delete must not drop a shared chunk
            self._pinned.append(ref.hash)
        self.store.put_kv_chunk(entry, data, dtype_name(tensor.dtype))  # type: ignore[arg-type]  # pack_kv just hashed them
        with self._lock:
            self._entries.append(entry)
            self.bytes_written += ref.size
            self.raw_bytes += ref.raw_size
            done = self.bytes_written
        if self.progress is not None:
            self.progress(done)
        return entry

    def add_session(self, session_id: str, state: dict[str, Any], num_kv_tokens: int,
                    handed_over: bool = False) -> SessionEntry:
        """`handed_over`: `state` is a fresh dict of plain JSON (lists, str-keyed dicts, scalars)
        that the caller will not touch again (a snapshot's SessionState.to_dict): checked, not
        copied; the copy through JSON costs as much as the check again (~0.1 ms per 1k tokens, on
        every protection round of every session)."""
        held = self._state_from.get(session_id) or {}
        state_from = {k: n for k, n in held.items() if isinstance(state.get(k), list) and len(state[k]) >= n}
        if state_from:  # a shallow copy: the caller's lists stay whole
            state = {**state, **{k: state[k][n:] for k, n in state_from.items()}}
        try:  # checked (and normalised) through JSON now, so commit cannot fail (or silently change NaN) later
            data = json.dumps(state, allow_nan=False)
            if not handed_over:
                state = json.loads(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"session {session_id}: state is not plain JSON ({exc})") from None
        entry = SessionEntry(session_id=session_id, state=state, num_kv_tokens=num_kv_tokens,
                             kv_from=min(num_kv_tokens, self._kv_from.get(session_id, 0)), state_from=state_from)
        with self._lock:
            self._check_open()
            if session_id in self._sessions:
                raise ValueError(f"session {session_id} added twice to checkpoint {self.checkpoint_id}")
            self._sessions[session_id] = entry
        return entry

    def commit(
        self,
        model: ModelRef,
        source_layout: dict[str, Any],
        kv: KVGeometry,
        meta: dict[str, Any] | None = None,
    ) -> Manifest:
        """Validate completeness, then write the manifest (the checkpoint becomes visible)."""
        with self._lock:
            self._check_open()
            if self._dtype is not None and (dtype_name(self._dtype), self._head_dim) != (kv.dtype, kv.head_dim):
                raise ValueError(
                    f"declared KV geometry {kv.dtype}×{kv.head_dim} differs from the chunks written "
                    f"({dtype_name(self._dtype)}×{self._head_dim})"
                )
            if self._dtype is not None and self._scaled != (kv.scale is not None):
                raise ValueError(f"declared KV scale {kv.scale} does not match the chunks written "
                                 f"({'with' if self._scaled else 'without'} scales)")
            entries = sorted(self._entries, key=lambda e: (e.session_id, e.layer, e.head_lo, e.tok_lo))
            manifest = Manifest(
                checkpoint_id=self.checkpoint_id,
                created_at=time.time(),
                model=model,
                source_layout=source_layout,
                kv=kv,
                sessions=list(self._sessions.values()),
                kv_entries=entries,
                meta=dict(meta or {}),
            )
            gap = manifest.coverage_error(from_kv_from=True)
            if gap is not None:
                raise ValueError(f"checkpoint {self.checkpoint_id} is incomplete: {gap}")
            self.store.put_manifest(self.checkpoint_id, manifest.to_bytes())
            self._release()
        return manifest

    def abort(self) -> None:
        """Give up: nothing becomes visible; written chunks are left for garbage collection."""
        with self._lock:
            if not self._closed:
                self._release()

    def _release(self) -> None:
        self._closed = True
        self.store.unpin(self._pinned)
        self._pinned = []

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"checkpoint writer {self.checkpoint_id} is already committed or aborted")


class CheckpointReader:
    """Reads a committed checkpoint; ``read_kv`` re-slices KV for any target head range."""

    def __init__(self, store: Store, checkpoint_id: str | None = None, manifest: Manifest | None = None) -> None:
        self.store = store
        if manifest is None:
            if checkpoint_id is None:
                raise ValueError("CheckpointReader needs a checkpoint_id or a manifest")
            manifest = Manifest.parse(store.get_manifest(check_id(checkpoint_id)))
            if manifest.checkpoint_id != checkpoint_id:
                raise CorruptCheckpoint(
                    f"manifest stored as {checkpoint_id} names checkpoint {manifest.checkpoint_id}"
                )
        self.manifest = manifest
        self._by_key: dict[tuple[str, int], list[KVEntry]] = {}
        for e in manifest.kv_entries:
            self._by_key.setdefault((e.session_id, e.layer), []).append(e)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.manifest.kv.dtype)

    def check_model(self, fingerprint: str) -> None:
        m = self.manifest.model
        if m.fingerprint != fingerprint:
            raise ModelMismatch(
                f"checkpoint {self.manifest.checkpoint_id} was taken from model {m.name!r} "
                f"(fingerprint {m.fingerprint}); the target's fingerprint is {fingerprint}"
            )

    def read_kv(self, session_id: str, layer: int, head_lo: int, head_hi: int) -> torch.Tensor:
        """K and V for heads [head_lo, head_hi) over all the session's tokens: [2, hi-lo, T, head_dim]."""
        return self.read_kv_ranges(session_id, layer, [(head_lo, head_hi)])[0]

    def read_kv_ranges(self, session_id: str, layer: int, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
        """``read_kv`` for several head ranges of one layer (e.g. every target TP rank), fetching
        each chunk once across all of them. Quantised KV comes back dequantised, as float32."""
        g = self.manifest.kv
        cache: dict = {}  # fetch each chunk once per call
        outs = []
        num_tokens = self._num_tokens(session_id)
        for head_lo, head_hi in ranges:
            entries = self._covering(session_id, layer, head_lo, head_hi)
            dtype = self.dtype if g.scale is None else torch.float32
            out = torch.empty((2, head_hi - head_lo, num_tokens, g.head_dim), dtype=dtype)
            for e, t, scale in self._pieces(entries, cache):
                lo, hi = max(head_lo, e.head_lo), min(head_hi, e.head_hi)
                piece = t[:, lo - e.head_lo : hi - e.head_lo]
                if scale is not None:
                    piece = piece.float() * scale[:, lo - e.head_lo : hi - e.head_lo].unsqueeze(-1)
                out[:, lo - head_lo : hi - head_lo, e.tok_lo : e.tok_hi] = piece
            outs.append(out)
        return outs

    def read_tokens(self, session_id: str, tok_lo: int, tok_hi: int) -> torch.Tensor:
        """K and V of every layer and KV head for tokens [tok_lo, tok_hi) of a session:
        [layers, 2, heads, tokens, head_dim]. Works on a delta round's manifest too (its KV listed
        from the session's kv_from on): coverage is checked over [tok_lo, tok_hi) only."""
        g = self.manifest.kv
        if g.scale is not None:
            raise ValueError(f"checkpoint {self.manifest.checkpoint_id} holds quantised KV: read it with kv_scaled_pieces")
        self._num_tokens(session_id)  # KeyError for a session not in it
        out = torch.empty((g.num_layers, 2, g.num_kv_heads, tok_hi - tok_lo, g.head_dim), dtype=self.dtype)
        cache: dict = {}
        for layer in range(g.num_layers):
            entries = [e for e in self._by_key.get((session_id, layer), []) if e.tok_lo < tok_hi and e.tok_hi > tok_lo]
            gap = coverage_gap(entries, 0, g.num_kv_heads, tok_hi, tok_from=tok_lo)
            if gap is not None:
                raise CorruptCheckpoint(f"checkpoint {self.manifest.checkpoint_id} session {session_id} layer {layer}: {gap}")
            for e, t, _ in self._pieces(entries, cache):
                a, b = max(tok_lo, e.tok_lo), min(tok_hi, e.tok_hi)
                out[layer, :, e.head_lo:e.head_hi, a - tok_lo:b - tok_lo] = t[:, :, a - e.tok_lo:b - e.tok_lo]
        return out

    def _num_tokens(self, session_id: str) -> int:
        try:
            return self.manifest.session(session_id).num_kv_tokens
        except KeyError:
            raise KeyError(f"session {session_id} is not in checkpoint {self.manifest.checkpoint_id}") from None

    def kv_pieces(
        self, session_id: str, layer: int, head_lo: int, head_hi: int,
        cache: dict | None = None,
    ) -> Iterator[tuple[KVEntry, torch.Tensor]]:
        """The entries of one layer overlapping heads [head_lo, head_hi), in manifest order, each with
        its verified chunk as a [2, entry heads, entry tokens, head_dim] tensor that may share memory
        with the store: READ-ONLY, copy out of it. Range and coverage (heads × all the session's
        tokens) are checked here, before any chunk is fetched; `cache` keeps views across calls."""
        if self.manifest.kv.scale is not None:
            raise ValueError(f"checkpoint {self.manifest.checkpoint_id} holds quantised KV: read it with kv_scaled_pieces")
        return ((e, t) for e, t, _ in self._pieces(self._covering(session_id, layer, head_lo, head_hi), cache))

    def kv_scaled_pieces(self, session_id: str, layer: int, head_lo: int, head_hi: int
                         ) -> Iterator[tuple[KVEntry, torch.Tensor, torch.Tensor | None]]:
        """kv_pieces with each chunk's float32 [2, heads, tokens] scales (None: the KV is not quantised)."""
        return self._pieces(self._covering(session_id, layer, head_lo, head_hi), None)

    def kv_stored(self, session_id: str, layer: int, head_lo: int, head_hi: int) -> Iterator[tuple[KVEntry, bytes]]:
        """kv_pieces' entries (range and coverage checked) with their chunks' stored bytes, NOT verified:
        for a caller that hashes each chunk as it copies it (storage.format.chunks.kv_stream_view) and checks
        the hash before it uses what it copied; read-only."""
        return ((e, self.store.get_chunk(e.chunk.hash)) for e in self._covering(session_id, layer, head_lo, head_hi))

    def _covering(self, session_id: str, layer: int, head_lo: int, head_hi: int) -> list[KVEntry]:
        g = self.manifest.kv
        num_tokens = self._num_tokens(session_id)
        if not (0 <= layer < g.num_layers and 0 <= head_lo < head_hi <= g.num_kv_heads):
            raise ValueError(
                f"layer {layer} heads [{head_lo},{head_hi}) outside the checkpoint's "
                f"{g.num_layers} layers × {g.num_kv_heads} KV heads"
            )
        entries = [e for e in self._by_key.get((session_id, layer), []) if e.head_lo < head_hi and e.head_hi > head_lo]
        gap = coverage_gap(entries, head_lo, head_hi, num_tokens)
        if gap is not None:
            raise CorruptCheckpoint(f"checkpoint {self.manifest.checkpoint_id} session {session_id} layer {layer}: {gap}")
        return entries

    def _pieces(self, entries: list[KVEntry], cache: dict | None
                ) -> Iterator[tuple[KVEntry, torch.Tensor, torch.Tensor | None]]:
        cache = {} if cache is None else cache
        for e in entries:
            shape = e.shape(self.manifest.kv.head_dim)
            key = (e.chunk.hash, shape)
            got = cache.get(key)
            if got is None:
                got = cache[key] = self._load(e, shape)
            yield e, *got

    def _load(self, e: KVEntry, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The verified chunk of `e` and its scales (None if unquantised), read-only (see kv_pieces)."""
        try:
            m = self.manifest
            data = self.store.get_chunk(e.chunk.hash)
            if m.kv.scale is not None:
                return kv_scaled_view(data, e.chunk, shape, m.kv.dtype)
            return kv_view(data, e.chunk, shape, m.kv.dtype, m.format_version), None
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(f"{exc} (session {e.session_id}, layer {e.layer})") from None

    def verify(self) -> int:
        """Fetch and check every chunk (hash, codec, shape, dtype) and coverage; return bytes checked.

        Run before touching a target replica, so a bad checkpoint changes nothing there.
        """
        gap = self.manifest.coverage_error()
        if gap is not None:
            raise CorruptCheckpoint(f"checkpoint {self.manifest.checkpoint_id} is incomplete: {gap}")
        seen: set[tuple[str, tuple[int, ...]]] = set()
        todo = []
        for e in self.manifest.kv_entries:
            shape = e.shape(self.manifest.kv.head_dim)
            if (e.chunk.hash, shape) in seen:
                continue
            seen.add((e.chunk.hash, shape))
            todo.append((e, shape))
        parallel_map(lambda x: self._load(*x) is None, todo)  # hashing releases the GIL: all cores; keep nothing
        return sum(e.chunk.size for e, _ in todo)

    def total_bytes(self) -> int:
        """Stored bytes of the distinct chunks (what a transfer of this checkpoint moves)."""
        return sum({e.chunk.hash: e.chunk.size for e in self.manifest.kv_entries}.values())


__all__ = ["CheckpointWriter", "CheckpointReader"]
