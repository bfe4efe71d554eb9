"""Checkpoint manifest: the versioned JSON index of a checkpoint (docs/format.md).

The manifest names the model, the source layout (informational only), the KV geometry,
every session's opaque state and every KV chunk. Chunks are stored per session, per
layer, per KV-head range and token range in a layout-independent order, so a restore
under any layout reads exactly the slices it needs.

Parsing is defensive: the manifest may come from an untrusted store or peer, so sizes
are capped, every field is bounded and cross-references are checked before any caller
sees the object. Anything wrong surfaces as ``CorruptCheckpoint``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)
from relayout.storage.errors import CorruptCheckpoint

# 2: chunks store their tensor token-major, [2, tokens, heads, head_dim] (the KV pool's order);
# 1: [2, heads, tokens, head_dim]. Readers take both; writers write FORMAT_VERSION.
FORMAT_VERSION = 2
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
HASH_PATTERN = r"^[0-9a-f]{32}$"  # xxh3_128 hexdigest

# Safetensors framing around the "kv" tensor: 8-byte header length + a short JSON header.
# Bounding it lets the manifest bound every chunk's decoded size from its geometry.
SAFETENSORS_OVERHEAD_MAX = 1024

DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
KVDtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
# "token_head": each chunk also holds "kv_scale", float32 [2, tokens, heads] (logical [2, heads, tokens]):
# value = stored element * scale (fp8 KV)
KVScale = Literal["token_head"]
Codec = Literal["none", "zstd", "zstd-planes"]

Id = Annotated[str, Field(pattern=ID_PATTERN, max_length=128)]
Count = Annotated[int, Field(ge=0, le=2**32)]
Small = Annotated[int, Field(ge=0, le=2**20)]
ByteSize = Annotated[int, Field(ge=0, le=2**40)]

_CFG = ConfigDict(extra="forbid", strict=True)


class ChunkRef(BaseModel):
    model_config = _CFG
    hash: str = Field(pattern=HASH_PATTERN)
    size: ByteSize  # stored (encoded) bytes; what the hash covers
    raw_size: ByteSize  # decoded safetensors payload bytes
    codec: Codec


class KVEntry(BaseModel):
    """K and V of one session, one layer, KV heads [head_lo, head_hi), tokens [tok_lo, tok_hi)."""

    model_config = _CFG
    session_id: Id
    layer: Small
    head_lo: Small
    head_hi: Small
    tok_lo: Count
    tok_hi: Count
    chunk: ChunkRef

    @model_validator(mode="after")
    def _ranges(self) -> KVEntry:
        if not (self.head_lo < self.head_hi and self.tok_lo < self.tok_hi):
            raise ValueError(
                f"empty range in KV entry session={self.session_id} layer={self.layer}: "
                f"heads [{self.head_lo},{self.head_hi}) tokens [{self.tok_lo},{self.tok_hi})"
            )
        return self

    def shape(self, head_dim: int) -> tuple[int, int, int, int]:
        return (2, self.head_hi - self.head_lo, self.tok_hi - self.tok_lo, head_dim)


class SessionEntry(BaseModel):
    model_config = _CFG
    session_id: Id
    state: dict[str, Any]  # opaque JSON written by the engine
    num_kv_tokens: Count
    # > 0 only in one round of a protection stream (a "delta"): this manifest lists the session's KV
    # from this token on, the receiver holds the rest from earlier rounds. Never in a checkpoint:
    # a reader's coverage check counts from token 0, so a delta cannot be restored by mistake.
    kv_from: Count = 0
    # the same kind of delta for the state: each list of `state` named here is given from this index
    # on, the receiver holds the items before it from the round before (Manifest.with_whole_states).
    # A long session's token ids are otherwise serialised, sent and parsed whole on every round.
    state_from: dict[str, Count] = Field(default_factory=dict, max_length=64)

    @model_validator(mode="after")
    def _kv_from_within(self) -> SessionEntry:
        if self.kv_from > self.num_kv_tokens:
            raise ValueError(f"session {self.session_id}: kv_from {self.kv_from} beyond its {self.num_kv_tokens} "
                             "KV tokens")
        return self

    @model_serializer(mode="wrap")
    def _omit_zero_kv_from(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a checkpoint's manifest stays byte-for-byte what earlier releases wrote and read
        out = handler(self)
        if not self.kv_from:
            out.pop("kv_from", None)
        if not self.state_from:
            out.pop("state_from", None)
        return out


class ModelRef(BaseModel):
    model_config = _CFG
    name: str = Field(max_length=1024)
    fingerprint: str = Field(min_length=1, max_length=256)
    config: dict[str, Any]


class KVGeometry(BaseModel):
    model_config = _CFG
    num_layers: Small
    num_kv_heads: Small
    head_dim: Small
    dtype: KVDtype
    scale: KVScale | None = None  # None: the stored values are the KV itself

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    def chunk_bytes(self, heads: int, tokens: int) -> int:
        """Tensor bytes of one chunk of `heads` KV heads × `tokens` tokens (scales included)."""
        return 2 * heads * tokens * (self.head_dim * self.itemsize + (4 if self.scale else 0))


class Manifest(BaseModel):
    model_config = _CFG
    format_version: Literal[1, 2] = FORMAT_VERSION
    checkpoint_id: Id
    created_at: float = Field(ge=0, allow_inf_nan=False)
    model: ModelRef
    source_layout: dict[str, Any]
    kv: KVGeometry
    sessions: list[SessionEntry]
    kv_entries: list[KVEntry]
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _cross_refs(self) -> Manifest:
        tokens: dict[str, int] = {}
        kv_from: dict[str, int] = {}
        for s in self.sessions:
            if s.session_id in tokens:
                raise ValueError(f"session {s.session_id} declared twice")
            tokens[s.session_id], kv_from[s.session_id] = s.num_kv_tokens, s.kv_from
        g = self.kv
        for e in self.kv_entries:
            where = f"session={e.session_id} layer={e.layer} chunk={e.chunk.hash}"
            if e.session_id not in tokens:
                raise ValueError(f"KV entry for undeclared session ({where})")
            if e.layer >= g.num_layers:
                raise ValueError(f"layer outside geometry ({g.num_layers} layers) ({where})")
            if e.head_hi > g.num_kv_heads:
                raise ValueError(f"heads [{e.head_lo},{e.head_hi}) outside {g.num_kv_heads} KV heads ({where})")
            if e.tok_lo < kv_from[e.session_id]:
                raise ValueError(f"tokens [{e.tok_lo},{e.tok_hi}) before the session's kv_from "
                                 f"{kv_from[e.session_id]} ({where})")
            if e.tok_hi > tokens[e.session_id]:
                raise ValueError(
                    f"tokens [{e.tok_lo},{e.tok_hi}) beyond the session's {tokens[e.session_id]} ({where})"
                )
            data = g.chunk_bytes(e.head_hi - e.head_lo, e.tok_hi - e.tok_lo)
            if not data + 8 <= e.chunk.raw_size <= data + 8 + SAFETENSORS_OVERHEAD_MAX:
                raise ValueError(f"raw_size {e.chunk.raw_size} inconsistent with a {data}-byte tensor ({where})")
        return self

    # ---- serialisation -------------------------------------------------------------

    def to_bytes(self) -> bytes:
        data = self.model_dump_json().encode()
        if len(data) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpoint(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
        return data

    @classmethod
    def parse(cls, data: bytes) -> Manifest:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CorruptCheckpoint(f"manifest must be bytes, got {type(data).__name__}")
        if len(data) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpoint(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
        try:
            return cls.model_validate_json(bytes(data))
        except ValidationError as exc:
            raise CorruptCheckpoint(f"invalid manifest: {_summarise(exc)}") from None
        except (ValueError, RecursionError, UnicodeError) as exc:  # defensive: parser-level failures
            raise CorruptCheckpoint(f"invalid manifest: {exc}") from None

    # ---- queries --------------------------------------------------------------------

    def session(self, session_id: str) -> SessionEntry:
        for s in self.sessions:
            if s.session_id == session_id:
                return s
        raise KeyError(session_id)

    def coverage_error(self, from_kv_from: bool = False) -> str | None:
        """First gap in KV coverage (every session × layer × head × token), or None. Coverage counts
        from token 0 (a checkpoint), or with `from_kv_from` from each session's kv_from (a stream's
        round, whose receiver checks it continues what it holds). A checkpoint's states are whole."""
        if not from_kv_from:
            part = next((s for s in self.sessions if s.state_from), None)
            if part is not None:
                return (f"session {part.session_id}: its state continues an earlier round's (state_from "
                        f"{sorted(part.state_from)}): a protection round, not a checkpoint")
        by_key: dict[tuple[str, int], list[KVEntry]] = {}
        for e in self.kv_entries:
            by_key.setdefault((e.session_id, e.layer), []).append(e)
        for s in self.sessions:
            if s.num_kv_tokens == 0:
                continue
            for layer in range(self.kv.num_layers):
                gap = coverage_gap(by_key.get((s.session_id, layer), []), 0, self.kv.num_kv_heads, s.num_kv_tokens,
                                   s.kv_from if from_kv_from else 0)
                if gap is not None:
                    return f"session {s.session_id} layer {layer}: {gap}"
        return None

    def with_whole_states(self, before: Manifest | None) -> Manifest:
        """This round's manifest with every session's state whole: each list a session's `state_from`
        names continues the same list of its state in `before` (the round the receiver holds).
        CorruptCheckpoint if `before` does not hold what it continues."""
        if not any(s.state_from for s in self.sessions):
            return self
        held = {s.session_id: s.state for s in before.sessions} if before is not None else {}
        sessions = []
        for s in self.sessions:
            if not s.state_from:
                sessions.append(s)
                continue
            old, state = held.get(s.session_id), dict(s.state)
            for key, n in s.state_from.items():
                have, new = (old or {}).get(key), state.get(key)
                if not isinstance(have, list) or len(have) < n or not isinstance(new, list):
                    raise CorruptCheckpoint(f"session {s.session_id}: its state's {key!r} continues {n} items "
                                            "this receiver does not hold")
                state[key] = have[:n] + new
            sessions.append(s.model_copy(update={"state": state, "state_from": {}}))
        return self.model_copy(update={"sessions": sessions})


def coverage_gap(entries: list[KVEntry], head_lo: int, head_hi: int, num_tokens: int, tok_from: int = 0
                 ) -> str | None:
    """Describe the first cell of heads [head_lo, head_hi) × tokens [tok_from, num_tokens) no entry covers.

    Splits the head range at every entry boundary; within each elementary head interval the
    covering entries' token intervals must union to [tok_from, num_tokens).
    """
    if num_tokens <= tok_from or head_lo >= head_hi:
        return None
    cuts = {head_lo, head_hi}
    for e in entries:
        cuts.update(b for b in (e.head_lo, e.head_hi) if head_lo < b < head_hi)
    bounds = sorted(cuts)
    by_tok = sorted(entries, key=lambda e: e.tok_lo)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        reach = tok_from
        for e in by_tok:
            if e.head_lo <= lo and e.head_hi >= hi:
                if e.tok_lo > reach:
                    break
                reach = max(reach, e.tok_hi)
        if reach < num_tokens:
            return f"heads [{lo},{hi}) tokens from {reach} not covered (need [{tok_from},{num_tokens}))"
    return None


def _summarise(exc: ValidationError) -> str:
    errs = exc.errors(include_url=False, include_input=False)
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in errs[:3]]
    more = f" (+{len(errs) - 3} more)" if len(errs) > 3 else ""
    return "; ".join(parts) + more
