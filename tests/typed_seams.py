"""Read by a type checker, never run (tests/test_typed_seams.py runs mypy on it): each engine and
each engine's protocol operations against the Protocol it must implement. A missing method, or one
whose signature no longer fits, is a type error here."""

from __future__ import annotations

from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.surface import SessionEngine
from relayout.engine.vllm.engine import VllmEngine
from relayout.migrate.protocol.engine_ops import EngineThreadOps
from relayout.migrate.protocol.transfer_records import EngineOps
from relayout.migrate.protocol.vllm_ops import VllmOps


def builtin_engine(e: LLMEngine) -> SessionEngine:
    return e


def vllm_engine(e: VllmEngine) -> SessionEngine:
    return e


def builtin_ops(o: EngineThreadOps) -> EngineOps:
    return o


def vllm_ops(o: VllmOps) -> EngineOps:
    return o
