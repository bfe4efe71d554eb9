"""What a replica's API routes serve, handed to each route as a dependency (the app's
`state.served`): the engine thread's front (AsyncEngine) and the model's name. The engine itself is
read only for facts that never change (tokenizer, context limit, model directory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request

if TYPE_CHECKING:
    from relayout.engine.runtime.async_engine import AsyncEngine


@dataclass
class Served:
    aengine: AsyncEngine
    model_name: str
    chat_template: Any = None  # engine.api.chat.ChatTemplate, or None: the model has none

    @property
    def tok(self) -> Any:
        return self.aengine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.aengine.engine.max_model_len


async def served(request: Request) -> Served:
    # async: FastAPI runs a plain-def dependency on its thread pool, a thread hop per request
    return request.app.state.served
