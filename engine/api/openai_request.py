"""The request fields `/v1/completions` and `/v1/chat/completions` share, and how they become the
engine's `SamplingParams` (OpenAI's defaults where a field is unset)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from relayout.engine.runtime.engine import RequestError
from relayout.engine.runtime.session import SamplingParams


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI default: 1.0
    top_p: float | None = None
    top_k: int | None = None  # extension; -1 or 0 = no cut
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False  # extension: token_ids on each choice / chunk
    ignore_eos: bool = False  # extension
    n: int | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int, logprobs: int | None
                        ) -> SamplingParams:
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if not self.top_k or self.top_k < 0 else self.top_k,
            seed=self.seed,
            stop=[s for s in stop if s],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )
