"""Device streams and events as the KV stager (engine/ranks/staging.py) needs them: `CudaOps` on CUDA,
`HostOps` on the CPU (one implicit stream, work runs when launched), and the `StreamOps` interface
tests implement to record or defer work per stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class StreamOps:
    """What the stager needs of a device's streams and events. `launch(stream, fn)` runs `fn`,
    whose device work is enqueued on `stream`; `wait(stream, ev)` makes the stream (not the
    host) wait for `ev`; `synchronize(ev)` blocks the host."""

    pinned = False

    def compute_stream(self) -> Any:
        raise NotImplementedError

    def new_stream(self) -> Any:
        raise NotImplementedError

    def new_event(self) -> Any:
        raise NotImplementedError

    def record(self, ev: Any, stream: Any) -> None:
        raise NotImplementedError

    def wait(self, stream: Any, ev: Any) -> None:
        raise NotImplementedError

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        raise NotImplementedError

    def query(self, ev: Any) -> bool:
        raise NotImplementedError

    def synchronize(self, ev: Any) -> None:
        raise NotImplementedError

    def used_on(self, t: torch.Tensor, stream: Any) -> None:
        """`t` is used by work on `stream`: its memory must not be reused before that work ends."""


class HostEvent:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


class HostOps(StreamOps):
    """CPU: one implicit stream, work runs when launched, events complete when recorded."""

    pinned = False

    def compute_stream(self) -> Any:
        return "host"

    def new_stream(self) -> Any:
        return "host"

    def new_event(self) -> HostEvent:
        return HostEvent()

    def record(self, ev: HostEvent, stream: Any) -> None:
        ev.done = True

    def wait(self, stream: Any, ev: HostEvent) -> None:
        pass

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        fn()

    def query(self, ev: HostEvent) -> bool:
        return ev.done

    def synchronize(self, ev: HostEvent) -> None:
        pass


class CudaOps(StreamOps):
    pinned = True

    def __init__(self, device: torch.device):
        self.device = device

    def compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def record(self, ev: Any, stream: Any) -> None:
        ev.record(stream)

    def wait(self, stream: Any, ev: Any) -> None:
        stream.wait_event(ev)

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def query(self, ev: Any) -> bool:
        return bool(ev.query())

    def synchronize(self, ev: Any) -> None:
        ev.synchronize()

    def used_on(self, t: torch.Tensor, stream: Any) -> None:
        if t.is_cuda:
            t.record_stream(stream)  # one-off (overflow) scratch is freed while the copy may still run


def ops_for(device: torch.device) -> StreamOps:
    return CudaOps(device) if device.type == "cuda" else HostOps()
