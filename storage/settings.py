"""Every `RELAYOUT_*` environment variable, declared once: its type, default and meaning.

`settings()` reads the environment when called (never at import, so a test or a parent process may
set a variable before the code that reads it runs); `check_settings()` is what each server and CLI
entry point calls at start, so a bad value stops it with a message naming the variable instead of
surfacing mid-migration. docs/cli.md's table of variables is `settings_table()`'s output (a test
keeps them equal). It lives in the lowest package so every layer may read it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["READ_BY", "Settings", "SettingsError", "check_settings", "settings", "settings_table"]


class SettingsError(ValueError):
    """A RELAYOUT_* variable holds a value its declaration refuses; the message names it."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RELAYOUT_", env_ignore_empty=True, extra="ignore",
                                      case_sensitive=False)

    token: str | None = Field(None, description="the bearer token; with none set, nothing is authenticated")
    api_keys: str = Field("", description="comma-separated client API keys (as `--api-key`); with none the "
                                          "client routes are open")
    detach_grace_s: float = Field(60.0, ge=0, description="how long a session whose client vanished keeps its "
                                  "place before it is aborted ([replica-api.md](replica-api.md#disconnects))")
    health_s: float = Field(1.0, ge=0.1, description="how often the agent checks its replicas; a dead protected "
                            "one has its standby promote ([agent-api.md](agent-api.md#failover))")
    standby_autopromote: bool = Field(True, description="`0`: promote only when asked (the source's agent, a "
                                      "gateway, a client), never on a lapsed lease alone "
                                      "([protocol.md](protocol.md#protection-continuous-replication-to-a-standby))")
    reattach_wait_s: float = Field(120.0, ge=0, description="how long the gateway holds a stream whose session "
                                   "left its replica ([gateway.md](gateway.md))")
    data_dir: Path = Field(default_factory=lambda: Path.home() / ".relayout", description="the default checkpoint root "
                           "(`<dir>/checkpoints`) and the allowed `file://` root when `RELAYOUT_FILE_ROOTS` is "
                           "unset; the agent sets it for its replicas")
    file_roots: str | None = Field(None, description="`os.pathsep`-separated directories `file://` stores may "
                                   "use (the agent adds its data dir)")
    transfer_ttl_s: float = Field(60.0, ge=0.5, description="idle time after which a replica ends a live "
                                  "transfer alone ([protocol.md](protocol.md#leases))")
    precopy_mbps: float = Field(0.0, ge=0, description="pre-copy rounds pushed to a target at most this many "
                                "MB/s (0: no cap), so the source's decoding keeps its share of a CPU box; the "
                                "final round is never throttled "
                                "([protocol.md](protocol.md#push-mode-the-migrator-carries-no-kv))")
    precopy_nice: int | Literal["idle"] = Field(10, description="the nice value (0–19) of the threads that copy, "
                                                "hash and move a pre-copy round, made for that round only, or "
                                                "`idle` (Linux `SCHED_IDLE`: only cycles nothing else wants); "
                                                "the final round runs at normal priority")
    devices: str | None = Field(None, description="the node's accelerators the agent deals to its replicas "
                                "(`0,1,2,3`, or `none`); unset: what `nvidia-smi -L` lists "
                                "([agent-api.md](agent-api.md#devices))")
    gpu_memory_share: float = Field(0.9, gt=0, le=1, description="the `--gpu-memory-utilization` a vLLM replica "
                                    "gets on the devices dealt to it, unless its `vllm_args` give one")
    vllm_stage_fault: Literal["missing", "truncate", "shape", "hash"] | None = Field(
        None, description="fault tests only: every KV file a vLLM replica stages for a restore is damaged this "
                          "way after it is written, so vLLM's workers fail to load it and recompute the session")
    transport: Literal["tcp", "http", "mooncake"] = Field("tcp", description="how pushed rounds travel unless "
                                                          "the export names one: `tcp` (a raw framed TCP link to "
                                                          "the target), `http` or `mooncake` "
                                                          "([protocol.md](protocol.md#transport-interface))")
    mooncake_buffer_mb: int = Field(64, ge=1, le=1024, description="the receive ring a Mooncake round registers "
                                    "while it runs")
    mooncake_host: str | None = Field(None, description="the address this replica's Mooncake engine advertises "
                                      "(default: the address the request arrived on, or the route to the target)")
    mooncake_disabled: bool = Field(False, description="`1`: act as if Mooncake were not installed (asking for "
                                    "it is a 400)")
    link_port: int = Field(0, ge=0, le=65535, description="the port of the raw TCP frame link (0: ephemeral)")
    link_advertise: str | None = Field(None, pattern=r"^\S+:\d{1,5}$", description="`HOST:PORT` sources connect "
                                       "to for the frame link, where they reach it through a forwarded port "
                                       "(NAT, a Kubernetes Service)")
    link_idle_s: float = Field(30.0, ge=0.1, description="a frame link silent this long inside a round is a cut "
                               "round (kept for a resume)")
    shared_kv: bool = Field(True, description="`0`: local CPU ranks keep their KV pools private; by default each "
                            "puts its pool in `/dev/shm` (unlinked at once) and the driver copies KV in and out of "
                            "it directly")
    max_import_bytes: int | None = Field(None, ge=1, description="the most one incoming transfer may send, all "
                                         "rounds together (default 2 × KV pool + one manifest)")
    snapshot_keep_mb: int = Field(2047, ge=0, description="freed snapshot and round memory malloc keeps for the "
                                  "next one (at most 2047; 0: leave malloc alone)")
    kv_bytes: int = Field(256 << 20, ge=1, description="KV cache bytes per attention-DP group when "
                          "`--kv-cache-mb` is not given")
    staging_bytes: int = Field(2 << 30, ge=0, description="pinned host bytes kept per rank for KV staging")
    step_timeout_s: float = Field(300.0, gt=0, description="a rank that does not answer a step within this "
                                  "long takes the replica down (503)")
    rank_join_timeout_s: float = Field(600.0, gt=0, description="how long a driver waits for its ranks to join")
    cache: Path = Field(default_factory=lambda: Path.home() / ".cache" / "relayout", description="where builtin models are generated")
    launch_timeout: float | None = Field(None, gt=0, description="seconds a launched replica has to print its "
                                         "URL (default 180, 600 for a vLLM replica)")
    drain_target: str | None = Field(None, description="the default drain target of `relayout drain`")
    agents: str | None = Field(None, description="agents to pick a drain target from; the agents the "
                               "controller watches (comma or space separated)")

    @field_validator("precopy_nice", mode="before")
    @classmethod
    def _nice(cls, v: object) -> object:  # " IDLE " is idle; a nice value is clamped to 0..19
        if isinstance(v, str):
            v = v.strip().lower()
            if v != "idle":
                try:
                    v = int(v)
                except ValueError:
                    raise ValueError("a nice value 0..19 or idle") from None
        return max(0, min(19, v)) if isinstance(v, int) else v

    def api_key_list(self) -> list[str]:
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]

    def file_root_list(self) -> list[Path]:
        return [Path(r) for r in (self.file_roots or "").split(os.pathsep) if r]


READ_BY = {  # who reads each variable (the docs table's second column)
    "token": "agent, replica, gateway, rank, CLI, controller", "api_keys": "replica, gateway",
    "detach_grace_s": "replica", "health_s": "agent", "standby_autopromote": "replica (as a standby)",
    "reattach_wait_s": "gateway", "data_dir": "replica", "file_roots": "agent, replica",
    "transfer_ttl_s": "replica", "precopy_mbps": "replica (as a source)",
    "precopy_nice": "replica (both ends of a migration)", "transport": "replica (as a source)",
    "vllm_stage_fault": "replica (vLLM, in fault tests)", "devices": "agent", "gpu_memory_share": "agent",
    "mooncake_buffer_mb": "replica (as a target)", "mooncake_host": "replica", "mooncake_disabled": "replica",
    "link_port": "replica (as a target)", "link_advertise": "replica (as a target)",
    "link_idle_s": "replica (as a target)", "shared_kv": "replica", "max_import_bytes": "replica",
    "snapshot_keep_mb": "replica and ranks", "kv_bytes": "replica", "staging_bytes": "replica ranks",
    "step_timeout_s": "replica", "rank_join_timeout_s": "replica", "cache": "engine", "launch_timeout": "agent",
    "drain_target": "`relayout drain`", "agents": "`relayout drain`, `relayout controller`",
}


_cache: tuple[tuple, Settings] | None = None


def settings() -> Settings:
    """The RELAYOUT_* variables as they are now; SettingsError names a bad one. Parsed again only
    when one of them changed since the last call (a parse costs ~1 ms; some callers are per step)."""
    global _cache
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k[:9].upper() == "RELAYOUT_"))
    if _cache is not None and _cache[0] == key:
        return _cache[1]
    try:
        st = Settings()
        _cache = (key, st)
        return st
    except ValidationError as e:
        bad = "; ".join(f"RELAYOUT_{'_'.join(str(p) for p in err['loc'][:1]).upper()}: {err['msg']}"
                        for err in e.errors())
        raise SettingsError(f"bad environment: {bad}") from None


def check_settings() -> Settings:
    """At a process's start: every variable parses, or SettingsError naming each bad one."""
    return settings()


def _default(name: str) -> str:
    f = Settings.model_fields[name]
    d = f.default_factory() if f.default_factory is not None else f.default  # type: ignore[call-arg]
    if d is None:
        return "unset"
    if isinstance(d, bool):
        return "`1`" if d else "unset"
    if isinstance(d, Path):
        return "`~/" + str(d.relative_to(Path.home())) + "`" if d.is_relative_to(Path.home()) else f"`{d}`"
    if isinstance(d, int) and not isinstance(d, bool) and d >= 1 << 20 and d % (1 << 20) == 0:
        return f"{d >> 30} GiB" if d % (1 << 30) == 0 else f"{d >> 20} MiB"
    if d == "":
        return "none"
    return f"`{d:g}`" if isinstance(d, float) else f"`{d}`"


def settings_table() -> str:
    """docs/cli.md's table of the RELAYOUT_* variables, from the declarations above."""
    rows = ["| variable | read by | default | meaning |", "|---|---|---|---|"]
    for name, f in Settings.model_fields.items():
        rows.append(f"| `RELAYOUT_{name.upper()}` | {READ_BY[name]} | {_default(name)} | {f.description} |")
    return "\n".join(rows)
