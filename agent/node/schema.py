"""What callers may send the node agent: request bodies, ids and layouts checked before any
work starts. Ids, errors and their shape come from relayout.engine.web."""

from __future__ import annotations

import shlex
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field
from relayout.engine import web
from relayout.engine.vllm.args import VllmArgsError, check_vllm_args

OP_TIMEOUT = httpx.Timeout(900.0, connect=10.0)  # longer than a vLLM replica's launch (agent.node.state.launch_timeout)


# ---- request bodies ---------------------------------------------------------------------------
_STRICT = ConfigDict(extra="forbid")
Engine = Literal["builtin", "vllm"]  # who serves the replica: relayout's engine, or stock vLLM (docs: vLLM replicas)
VllmArgs = list[str] | None  # more flags for vLLM's own server, one argv item each (no shell)


class EngineChoice(BaseModel):
    """The serving engine of a replica the agent launches, and what only that engine takes."""

    model_config = _STRICT
    engine: Engine = "builtin"
    vllm_args: VllmArgs = Field(None, max_length=64)

    def checked_vllm_args(self) -> list[str]:
        if self.vllm_args and self.engine != "vllm":
            raise web.HTTPError(400, "vllm_args: only for engine vllm")
        for a in self.vllm_args or []:
            if not 0 < len(a) <= 512 or "\x00" in a:
                raise web.HTTPError(400, "vllm_args: each item 1..512 characters")
        try:
            check_vllm_args(list(self.vllm_args or []))
        except VllmArgsError as e:
            raise web.HTTPError(400, f"vllm_args: {e}") from None
        return list(self.vllm_args or [])


def serve_flags(engine: str, vllm_args: list[str] | None, attach: tuple[str, str] | None = None) -> list[str]:
    """The `relayout serve` flags of a replica served by `engine` (attached to a user's vLLM: `attach`)."""
    if engine != "vllm":
        return []
    if attach is not None:
        return ["--engine", "vllm", "--attach", attach[0], "--exchange", attach[1]]
    # one "--vllm-args=..." item: a lone value that starts with "-" would read as a flag of its own
    return ["--engine", "vllm", *([f"--vllm-args={shlex.join(vllm_args)}"] if vllm_args else [])]


class ReplicaBody(EngineChoice):
    model: str = Field(..., min_length=1, max_length=1024)
    layout: str | dict[str, Any] | None = None
    name: str | None = Field(None, pattern=web.ID_PATTERN, max_length=128)
    # a vLLM the user started with relayout's connector: served in front of, never started or stopped
    attach: str | None = Field(None, pattern=r"^https?://[^\s]+$", max_length=2048)
    exchange: str | None = Field(None, pattern=r"^/[^\x00]*$", max_length=1024)  # its exchange directory

    def checked_attach(self) -> tuple[str, str] | None:
        if self.attach is None and self.exchange is None:
            return None
        if self.engine != "vllm" or self.attach is None or self.exchange is None:
            raise web.HTTPError(400, "attach: needs engine vllm, attach (vLLM's URL) and exchange (its directory)")
        if self.vllm_args:
            raise web.HTTPError(400, "vllm_args: an attached vLLM was started with its own flags")
        return self.attach, self.exchange
    # checked by the agent (400 naming the allowed values), not here
    dtype: str | None = Field(None, max_length=32)  # float32, bfloat16, float16 (default: by device)
    kv_dtype: str | None = Field(None, max_length=32)  # auto, fp8_e4m3


class CheckpointBody(BaseModel):
    model_config = _STRICT
    destination: str | None = Field(None, max_length=4096)
    sessions: list[str] | None = Field(None, max_length=4096)
    stop: bool = False


class NewReplica(EngineChoice):
    model: str = Field(..., min_length=1, max_length=1024)
    layout: str | dict[str, Any] | None = None
    dtype: str | None = Field(None, max_length=32)
    kv_dtype: str | None = Field(None, max_length=32)


class RestoreBody(BaseModel):
    model_config = _STRICT
    checkpoint: str = Field(..., min_length=1, max_length=4096)
    replica: str | NewReplica
    sessions: list[str] | None = Field(None, max_length=4096)
    exact: bool = False  # refuse a checkpoint whose KV dtype differs from the replica's instead of converting


class MigrateTarget(BaseModel):
    model_config = _STRICT
    agent: str = Field(..., pattern=r"^https?://[^\s]+$", max_length=2048)
    replica: str | None = Field(None, pattern=web.ID_PATTERN, max_length=128)
    layout: str | dict[str, Any] | None = None
    engine: Engine | None = None  # of a new target replica (default: the source's)
    model: str | None = Field(None, max_length=1024)


class MigrateBody(BaseModel):
    model_config = _STRICT
    target: MigrateTarget
    sessions: list[str] | None = Field(None, max_length=4096)
    mode: Literal["live", "cold"] = "live"
    # how the source pushes the rounds (docs/protocol.md#transport-interface); None: the source's default
    transport: Literal["tcp", "http", "mooncake"] | None = None


class DrainBody(BaseModel):
    model_config = _STRICT
    target_agent: str = Field(..., pattern=r"^https?://[^\s]+$", max_length=2048)
    # a planned layout per replica (e.g. from `relayout plan`); the others keep theirs
    layouts: dict[str, str | dict] | None = Field(None, max_length=1024)
    # a running replica on the target (e.g. started ahead, as a vLLM one takes a minute) per replica
    # here: its sessions move into that one instead of one the drain launches
    target_replicas: dict[str, str] | None = Field(None, max_length=1024)


def validate_layout(model: str, layout: str | dict | None, engine: str = "builtin") -> str | None:
    """Parse and check a layout against the model (and, for vLLM, against what vLLM can express
    here) before anything is launched; 400 naming the field."""
    import json

    from relayout.engine.model.config import ModelConfig, ModelConfigError
    from relayout.engine.model.layout import Layout, LayoutError
    from relayout.engine.model.weights import ModelNotFoundError, resolve_model

    try:
        path = resolve_model(model)
    except (ModelNotFoundError, ValueError, OSError) as e:
        raise web.HTTPError(400, f"model: {e}") from None
    if engine == "vllm":
        from relayout.engine.vllm.server import check_layout, on_cuda, vllm_version

        if vllm_version() is None:
            raise web.HTTPError(400, "engine: vllm is not installed on this agent's host "
                                     "(pip install -e '.[vllm]')")
    try:
        cfg = ModelConfig.from_dir(path)
    except (ModelConfigError, ValueError, OSError) as e:
        if engine != "vllm":
            raise web.HTTPError(400, f"model: {e}") from None
        cfg = None  # a model vLLM serves that relayout's engine does not: vLLM judges it at launch
    try:
        lay = Layout.parse(layout)
        if cfg is not None:
            lay = lay.validate(cfg)
        if engine == "vllm":
            check_layout(lay, on_cuda())
    except (LayoutError, ValueError, TypeError) as e:
        raise web.HTTPError(400, f"layout: {e}") from None
    if layout is None:
        return None
    return json.dumps(lay.to_dict()) if isinstance(layout, dict) else layout
