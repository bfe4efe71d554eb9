"""KV pools of local CPU ranks in shared memory, mapped by their driver too.

A rank process on the driver's own host, on the CPU, allocates its KV pool in a file under
/dev/shm (mode 0600, its space reserved up front), maps it and unlinks it at once, keeping one
descriptor open; its driver maps the same memory through /proc/<rank pid>/fd/<fd>. Nothing is
left behind however either process ends. The driver then copies a session's KV straight between a chunk buffer and every rank's
pool (a snapshot, a restore, a live round), one memory copy, instead of sending it through each
rank's channel (a copy into a message, a socket hop, a read into a fresh buffer, a copy into
the pool). The rank keeps stepping meanwhile: blocks being exported hold KV of tokens already
computed, which never changes, and blocks being imported are reserved for a session that is
not running yet. Ranks on other hosts, CUDA ranks and RELAYOUT_SHARED_KV=0 keep the channel."""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass

import torch
from relayout.storage.settings import settings

SHM_DIR = "/dev/shm"


def shared_kv_enabled() -> bool:
    return settings().shared_kv and os.path.isdir(SHM_DIR)


@dataclass
class SharedPool:
    """Where a rank's pool lives, as the rank tells its driver: K of every layer, then V of every
    layer, each `shape` ([num_blocks, block_size, heads, head_dim]) of `dtype`, back to back in the
    (unlinked) file open as descriptor `fd` of process `pid`."""

    pid: int
    fd: int
    num_layers: int
    shape: list[int]
    dtype: str
    heads: list[int]  # the model's KV heads [lo, hi) this pool holds

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SharedPool:
        return cls(int(d["pid"]), int(d["fd"]), int(d["num_layers"]), [int(x) for x in d["shape"]], str(d["dtype"]),
                   [int(x) for x in d["heads"]])


def _dtype(name: str) -> torch.dtype:
    t = getattr(torch, name, None)
    if not isinstance(t, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return t


def _views(flat: torch.Tensor, num_layers: int, shape: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    per = flat.numel() // (2 * num_layers)
    layers = [flat[i * per : (i + 1) * per].view(shape) for i in range(2 * num_layers)]
    return layers[:num_layers], layers[num_layers:]


def create_pool(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, heads: tuple[int, int]
                ) -> tuple[SharedPool, list[torch.Tensor], list[torch.Tensor]] | None:
    """A zeroed pool in shared memory, or None where /dev/shm cannot hold it (the caller then
    allocates a private one). Its space is reserved now (fallocate): a tmpfs that fills up later
    must not turn into a SIGBUS in the middle of a step."""
    if not shared_kv_enabled() or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None  # (a float8 pool keeps scales beside it: it moves only out of one-rank replicas)
    numel = 2 * num_layers * int(torch.Size(shape).numel())
    fd, path = tempfile.mkstemp(prefix="relayout-kv-", dir=SHM_DIR)  # mode 0600
    try:
        os.posix_fallocate(fd, 0, numel * dtype.itemsize)
        flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    except (OSError, RuntimeError):
        os.close(fd)
        return None
    finally:
        os.unlink(path)
    flat.zero_()  # every page mapped now, as a private pool's torch.zeros would (not in the first transfer)
    k, v = _views(flat, num_layers, list(shape))
    return SharedPool(os.getpid(), fd, num_layers, list(shape), str(dtype).removeprefix("torch."), list(heads)), k, v


def attach_pool(p: SharedPool, pid: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The driver's mapping of the pool of its rank process `pid` (what it spawned, not what the
    message says)."""
    if p.pid != pid:
        raise ValueError(f"rank process {pid} offered the KV pool of process {p.pid}")
    dtype = _dtype(p.dtype)
    numel = 2 * p.num_layers * int(torch.Size(p.shape).numel())
    path = f"/proc/{pid}/fd/{p.fd}"
    if os.path.getsize(path) != numel * dtype.itemsize:
        raise ValueError(f"the KV pool of rank process {pid} does not have the size it declared")
    flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    flat.view(torch.uint8)[::4096].sum()  # map every page here now too: faults belong to the launch, not a transfer
    return _views(flat, p.num_layers, p.shape)
