"""The node's accelerators, dealt to the replicas the agent launches: each replica gets its own
devices (`CUDA_VISIBLE_DEVICES`) for its layout's world size, from those no running or starting
replica holds; a launch with too few free is refused (409) naming how many it needs and has.

What a replica holds is in its registry record (`devices`), so the free set is derived, never kept
beside it: a replica that stops or dies frees its devices, and an agent restart knows what its
adopted replicas hold. The node's devices are `RELAYOUT_DEVICES` when set (a list of ids, or `none`),
else what `nvidia-smi -L` lists (limited to the agent's own `CUDA_VISIBLE_DEVICES`), else none: on a
machine without GPUs nothing is dealt."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from relayout.agent.node.registry import ReplicaRecord
from relayout.engine.web import HTTPError
from relayout.storage.settings import settings

LIVE = ("starting", "running")


def node_devices() -> list[str]:
    """This node's accelerator ids, as CUDA_VISIBLE_DEVICES names them."""
    given = settings().devices
    if given is not None:
        return [] if given.strip().lower() in ("", "none") else [d.strip() for d in given.split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # the agent was itself given a subset: deal only those
        found = [d.strip() for d in visible.split(",") if d.strip() in found]
    return found


@dataclass
class DevicePlan:
    devices: list[str]  # what the replica gets (empty: none dealt)
    env: dict[str, str]
    vllm_args: list[str]  # the vLLM flags the share adds (none if the caller gave its own)


def plan_devices(node: list[str], records: Iterable[ReplicaRecord], world_size: int, engine: str,
                 vllm_args: list[str] | None) -> DevicePlan:
    """The devices a new replica of `world_size` ranks gets, or HTTPError 409 naming need and have."""
    if not node:
        return DevicePlan([], {}, [])
    held = {d for r in records if r.status in LIVE for d in r.devices}
    free = [d for d in node if d not in held]
    if len(free) < world_size:
        raise HTTPError(409, f"this replica needs {world_size} device(s); {len(free)} of the node's {len(node)} are "
                             f"free ({len(held & set(node))} held by other replicas)", code="no_devices")
    mine = free[:world_size]
    extra: list[str] = []
    given = vllm_args or []
    if engine == "vllm" and not any(a.split("=")[0] == "--gpu-memory-utilization" for a in given):
        # the devices are this replica's alone: vLLM may take the share the node's setting allows
        extra = ["--gpu-memory-utilization", str(settings().gpu_memory_share)]
    return DevicePlan(mine, {"CUDA_VISIBLE_DEVICES": ",".join(mine)}, extra)
