"""The driver <-> rank command channel: one TCP connection per rank, no pickle.

Ranks may run on other hosts (`relayout rank`), so what crosses this link is parsed, never
unpickled: each message is one frame in the storage stream's framing (magic, lengths, JSON
header, payload), whose header names the op, carries JSON metadata and describes the tensors
whose raw bytes make up the payload. Tensors go out without an extra copy (the payload is sent
from the tensors' own memory) and come in straight into the buffer the tensor is built on.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import torch
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.stream import (
    FRAME_PREFIX_BYTES,
    frame_head,
    parse_frame_header,
    parse_frame_prefix,
)

MAGIC_RANK = b"RLR1"
MAX_MESSAGE_BYTES = 8 << 30  # one message's payload (a step's logits, a KV range)
_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
            torch.bool)}


class ChannelClosed(ConnectionError):
    """The peer closed the connection (or it broke) — for a rank, the peer is gone."""


class ChannelError(ValueError):
    """A message that is not well-formed: wrong magic, lengths, header or tensor description."""


@dataclass
class Message:
    op: str
    meta: Any = None
    tensors: list[torch.Tensor] = field(default_factory=list)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


@dataclass
class Encoded:
    """A message ready to send: encode once, send to every rank that gets the same command."""

    head: bytes
    bufs: list[memoryview]


def encode(op: str, meta: Any = None, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...] = ()) -> Encoded:
    bufs = [_tensor_bytes(t) for t in tensors]
    header = {"op": op, "meta": meta,
              "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in tensors]}
    return Encoded(frame_head(MAGIC_RANK, header, sum(b.nbytes for b in bufs)), bufs)


class RankChannel:
    """Framed messages over a connected socket. Not thread-safe: one sender, one receiver."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        peer = sock.getpeername()
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.peer = f"{peer[0]}:{peer[1]}"
        else:  # a local socket (tests use socketpairs)
            self.peer = str(peer) or "local"

    def fileno(self) -> int:  # so multiprocessing.connection.wait / selectors can watch it
        return self.sock.fileno()

    def send(self, op: str, meta: Any = None, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...] = ()) -> None:
        self.send_encoded(encode(op, meta, tensors))

    def send_encoded(self, msg: Encoded) -> None:
        try:
            self.sock.sendall(msg.head)
            for b in msg.bufs:
                self.sock.sendall(b)
        except OSError as e:
            raise ChannelClosed(f"connection to {self.peer} broke while sending: {e}") from None

    def _read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                raise
            except OSError as e:
                raise ChannelClosed(f"connection to {self.peer} broke: {e}") from None
            if n == 0:
                raise ChannelClosed(f"{self.peer} closed the connection")
            got += n

    def recv(self, timeout: float | None = None) -> Message:
        """The next message; TimeoutError if none starts within `timeout` seconds."""
        self.sock.settimeout(timeout)
        prefix = bytearray(FRAME_PREFIX_BYTES)
        self._read_into(memoryview(prefix))
        self.sock.settimeout(None)  # once a message has begun, the rest is read whole
        try:
            _, hlen, plen = parse_frame_prefix(prefix, (MAGIC_RANK,), MAX_MESSAGE_BYTES)
        except CorruptCheckpoint as e:
            raise ChannelError(f"from {self.peer}: {e}") from None
        hraw = bytearray(hlen)
        self._read_into(memoryview(hraw))
        payload = bytearray(plen)
        self._read_into(memoryview(payload))
        try:
            header = parse_frame_header("rank message", hraw)
        except CorruptCheckpoint as e:
            raise ChannelError(f"from {self.peer}: {e}") from None
        return Message(str(header.get("op")), header.get("meta"), self._tensors(header.get("tensors"), payload))

    def _tensors(self, descs: Any, payload: bytearray) -> list[torch.Tensor]:
        if not isinstance(descs, list):
            raise ChannelError(f"from {self.peer}: 'tensors' must be a list")
        out, off = [], 0
        for d in descs:
            try:
                dtype = _DTYPES[d["dtype"]]
                shape = [int(x) for x in d["shape"]]
            except (KeyError, TypeError, ValueError):
                raise ChannelError(f"from {self.peer}: bad tensor description {str(d)[:200]}") from None
            if any(x < 0 for x in shape):
                raise ChannelError(f"from {self.peer}: negative dimension in {shape}")
            n = dtype.itemsize
            for x in shape:
                n *= x
            if off + n > len(payload):
                raise ChannelError(f"from {self.peer}: tensors describe more bytes than the payload's {len(payload)}")
            flat = (torch.frombuffer(payload, dtype=torch.uint8, offset=off, count=n) if n
                    else torch.empty(0, dtype=torch.uint8))
            out.append(flat.view(dtype).reshape(shape))
            off += n
        if off != len(payload):
            raise ChannelError(f"from {self.peer}: {len(payload) - off} payload bytes not described by any tensor")
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def split_hostport(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
