"""The node agent's registry (replicas and operations), kept in data_dir/registry.json.

Written atomically (tmp file + fsync + os.replace) after every change, so a crash leaves
either the old or the new file, never a torn one."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


class Registry:
    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / "registry.json"
        self.replicas: dict[str, dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
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
            self.replicas = {k: v for k, v in (raw.get("replicas") or {}).items() if isinstance(v, dict)}
            self.operations = {k: v for k, v in (raw.get("operations") or {}).items() if isinstance(v, dict)}

    def save(self) -> None:
        with self._lock:
            data = json.dumps({"replicas": self.replicas, "operations": self.operations}, indent=1, default=str)
            tmp = self.path.with_name(f".registry.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
