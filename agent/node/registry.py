"""The node agent's registry (replicas and operations), kept in data_dir/registry.json.

Each replica is a `ReplicaRecord` and each operation an `Operation`: typed records that become
JSON only at the edges (the registry file, the agent's answers). Written atomically (tmp file +
fsync + os.replace) after every change, so a crash leaves either the old or the new file, never a
torn one."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

R = TypeVar("R", bound="Record")


class Record:
    """A registry record: plain JSON at the edges (`view`, `from_json`), typed in between."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()  # string fields a stored record must have to be read back
    OPTIONAL: ClassVar[tuple[str, ...]] = ()  # fields shown only once set

    def view(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)  # (a drain's entries in its result too)
        for k in self.OPTIONAL:
            if out[k] is None:
                del out[k]
        return out

    @classmethod
    def from_json(cls: type[R], raw: Any) -> R | None:
        """The record `raw` stores (unknown keys ignored), or None where it is not one."""
        if not isinstance(raw, dict) or not all(isinstance(raw.get(k), str) for k in cls.REQUIRED):
            return None
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in raw.items() if k in names})


@dataclass
class ReplicaRecord(Record):
    """A replica this agent launched (or adopted after a restart): what it runs and where."""

    id: str
    model: str
    engine: str = "builtin"  # records from before engines were recorded are builtin
    layout: str | None = None
    status: str = "starting"  # starting | running | dead | stopped
    pid: int | None = None
    url: str | None = None
    created_at: float = 0.0
    vllm_args: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)  # dealt to it alone (agent.node.devices)
    attach: str | None = None  # the vLLM server it fronts, when attached to one it did not start
    exit_code: int | None = None
    # protection, as the health check sees it (agent.node.failover): its id and standby while the
    # replica answers; the failover's outcome once it died, or the last attempt still being retried
    protected_to: dict[str, str] | None = None
    failover: dict[str, Any] | None = None
    failover_attempt: dict[str, Any] | None = None

    REQUIRED = ("id", "model")
    OPTIONAL = ("attach", "protected_to", "failover", "failover_attempt")


@dataclass
class Operation(Record):
    """One checkpoint, restore, migration or drain the agent runs (docs/agent-api.md "Operations")."""

    id: str
    kind: str
    replica: str | None = None
    state: str = "pending"  # pending | running | succeeded | failed | aborted
    phase: str = "queued"
    bytes_done: int = 0
    bytes_total: int | None = None
    stall_ms: float | None = None
    error: str | None = None
    result: Any = None  # the kind's result, shown while it runs (a drain's entries)
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    target_replica: str | None = None  # a migration's target, known before the move
    transfer: str | None = None  # a migration's transfer id, as both replicas know it

    REQUIRED = ("id", "kind")
    OPTIONAL = ("finished_at", "target_replica", "transfer")

    @property
    def live(self) -> bool:
        return self.state in ("pending", "running")


class Registry:
    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / "registry.json"
        self.replicas: dict[str, ReplicaRecord] = {}
        self.operations: dict[str, Operation] = {}
        self._lock = threading.Lock()

    def load(self) -> None:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            # unreadable registry: keep a copy for the operator, start empty
            try:
                os.replace(self.path, self.path.with_suffix(".corrupt"))
            except OSError:
                pass
            return
        if isinstance(raw, dict):
            reps = (ReplicaRecord.from_json(v) for v in (raw.get("replicas") or {}).values())
            ops = (Operation.from_json(v) for v in (raw.get("operations") or {}).values())
            self.replicas = {r.id: r for r in reps if r is not None}
            self.operations = {o.id: o for o in ops if o is not None}

    def save(self) -> None:
        with self._lock:
            data = json.dumps({"replicas": {k: r.view() for k, r in self.replicas.items()},
                               "operations": {k: o.view() for k, o in self.operations.items()}},
                              indent=1, default=str)
            tmp = self.path.with_name(f".registry.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
