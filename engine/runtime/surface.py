"""The session surface every engine of a replica offers: `LLMEngine` (relayout's own) and
`VllmEngine` (stock vLLM behind relayout's connector). The engine thread (AsyncEngine), the OpenAI
API and the moves call only these; a type checker holds both engines to it (tests/typed_seams.py).
How each engine takes in a moved session (`adopt`) differs, and lives with its protocol operations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from relayout.engine.model.config import ModelConfig
    from relayout.engine.model.layout import Layout
    from relayout.engine.runtime.engine import TokenEvent
    from relayout.engine.runtime.session import SamplingParams, SessionState, SessionStatus


class SessionEngine(Protocol):
    engine_name: str  # "builtin" or "vllm": which protocol operations serve it (migrate.protocol.engine_ops_for)
    cfg: ModelConfig
    layout: Layout
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV pool's element type

    @property
    def fingerprint(self) -> str: ...

    # ---- sessions in and out -----------------------------------------------------------------------
    def add_session(self, prompt_token_ids: list[int], params: SamplingParams,
                    session_id: str | None = None) -> SessionState: ...

    def get(self, session_id: str) -> SessionState | None: ...

    def abort(self, session_id: str, reason: str = "abort") -> None: ...

    def discard(self, session_id: str) -> None: ...

    # ---- moving: hold, hand over, take back ----------------------------------------------------------
    def pause(self, session_ids: list[str]) -> None: ...

    def resume(self, session_ids: list[str]) -> None: ...

    def release(self, session_ids: list[str], status: SessionStatus = ...) -> None: ...

    # ---- the step loop ---------------------------------------------------------------------------------
    def has_work(self) -> bool: ...

    def step(self) -> list[TokenEvent]: ...

    def shutdown(self) -> None: ...

    # ---- what the replica reports -----------------------------------------------------------------------
    def engine_info(self) -> dict: ...

    def expert_stats(self) -> dict: ...

    def kv_blocks_used(self) -> int: ...
