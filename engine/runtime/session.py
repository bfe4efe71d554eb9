"""Session state: everything about one in-flight request except its KV tensors.

This dataclass is the seam that checkpoints and migrations use: whatever is needed to
continue a session token-for-token on another replica lives here (the KV cache is
reached through the replica's block table and exported separately).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any


class SessionStatus(str, Enum):
    WAITING = "waiting"  # admitted, prefill not finished
    RUNNING = "running"
    PAUSED = "paused"  # held at a step boundary (being checkpointed or migrated)
    FINISHED = "finished"
    MIGRATED = "migrated"  # moved to another replica; this one no longer owns it
    CHECKPOINTED = "checkpointed"  # released by a checkpoint with stop; continues where it is restored


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 ⇒ greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 ⇒ no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: the chosen token's logprob and the k most likely (engine/runtime/logprobs.py)
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class SessionState:
    session_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    # torch.Generator state (CPU generator, uint8 bytes) for seeded sampling: the session
    # owns it, so its tokens never depend on what else is batched with it.
    rng_state: bytes | None = None
    status: SessionStatus = SessionStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" (a released session keeps None)
    num_sent: int = 0  # generated tokens already delivered to the client
    num_computed: int = 0  # tokens whose K/V are in the cache
    dp_group: int = 0  # attention data-parallel group that holds its KV
    created_at: float = field(default_factory=time.time)
    # per generated token when sampling.logprobs is set: [chosen logprob, top ids, top logprobs]
    # (engine/runtime/logprobs.py); part of the state so the values survive a checkpoint or a move
    logprobs: list[list] = field(default_factory=list)
    # how the client asked ("completion" | "chat", usage chunk or not): a stream resumed after a
    # move is shaped the same way (engine/api/streaming.py)
    api: str = "completion"
    include_usage: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in (SessionStatus.FINISHED, SessionStatus.MIGRATED, SessionStatus.CHECKPOINTED)

    def to_dict(self) -> dict:
        """Plain JSON-ready data (what dataclasses.asdict makes of it), a copy sharing nothing with
        the session: a migration round's cut takes it on the engine thread while the session decodes
        on. The token-id lists are copied whole (asdict walks every id: with a deepcopy of the state
        before it, ~0.2 ms a session at a thousand tokens on every round of a protection)."""
        d = {name: list(v) if name in _INT_LIST_FIELDS and type(v) is list else _plain(v)
             for name in _FIELD_NAMES for v in (getattr(self, name),)}
        d["status"] = self.status.value
        d["rng_state"] = self.rng_state.hex() if self.rng_state is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SessionState:
        d = dict(d)  # fields missing from older checkpoints take their defaults
        d["sampling"] = SamplingParams(**d["sampling"])
        d["status"] = SessionStatus(d["status"])
        rs = d.get("rng_state")
        d["rng_state"] = bytes.fromhex(rs) if rs else None
        return cls(**d)


_FIELD_NAMES = tuple(f.name for f in fields(SessionState))
_INT_LIST_FIELDS = frozenset(f.name for f in fields(SessionState) if f.type in ("list[int]", list[int]))
_SCALARS = (str, int, float, bool, bytes, type(None))


def _plain(v: Any) -> Any:
    """What asdict makes of a field's value: dataclasses as dicts, containers copied, anything else deep-copied."""
    if type(v) in _SCALARS:
        return v
    if type(v) is list:
        return [_plain(x) for x in v]
    if type(v) is dict:
        return {k: _plain(x) for k, x in v.items()}
    if is_dataclass(v) and not isinstance(v, type):
        # field by field, as asdict does, without its deepcopy of every leaf (the sampling parameters,
        # copied at every cut: a protection round's cut of 8 sessions 0.59-0.60 ms against 0.64)
        return {f.name: _plain(getattr(v, f.name)) for f in fields(v)}
    if isinstance(v, Enum):
        return v  # (an enum member is its own copy)
    return copy.deepcopy(v)
