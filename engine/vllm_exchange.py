"""What relayout's vLLM connector and the replica process in front of vLLM hand each other: KV files
in a staging directory (tmpfs where there is one) and one JSON line per command on a Unix socket.

No vLLM import here: the replica process reads and writes these without loading vLLM.

- An **export** (a cut of running requests): the replica asks the scheduler-side connector over the
  socket; it resolves each request's blocks at the next step and every worker writes
  `rank{r}.safetensors` into the export's directory: one tensor `kv` [layers, 2, local KV heads,
  tokens, head_dim] of tokens [tok_lo, tok_hi), its head range and token range in the metadata.
- A **load** (a session arriving): the replica writes one `LoadPiece` file per arrived token range,
  all KV heads, and names them in the request's `kv_transfer_params`; the workers copy each rank's
  heads of them into the request's blocks before the step that would compute those tokens."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SESSION_KEY = "relayout_session"  # kv_transfer_params: the relayout session a vLLM request serves
LOAD_KEY = "relayout_load"  # kv_transfer_params: {"tokens": n, "files": [path, ...]} KV to import


class ExchangeError(RuntimeError):
    """The connector refused or could not do what the replica asked (the session is untouched).
    `finished`: vLLM no longer runs the session's request (it ended there), not a failure."""

    def __init__(self, message: str, finished: bool = False):
        super().__init__(message)
        self.finished = finished


def staging_root() -> Path:
    """Where a replica's exchange files live: tmpfs when the machine has one (no disk I/O)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))


def write_kv(path: Path | str, kv: torch.Tensor, head_lo: int, head_hi: int, tok_lo: int, tok_hi: int) -> None:
    """One KV file, visible only once complete (rename): `kv` is [layers, 2, heads, tokens, head_dim]."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    save_file({"kv": kv.contiguous()}, str(tmp), metadata={"head_lo": str(head_lo), "head_hi": str(head_hi),
                                                            "tok_lo": str(tok_lo), "tok_hi": str(tok_hi)})
    os.replace(tmp, path)


def write_error(path: Path | str, message: str) -> None:
    """A worker that could not write its KV file says why, in its place (`<file>.error`)."""
    Path(f"{path}.error").write_text(message[:4000])


@dataclass
class KVFile:
    path: str
    head_lo: int
    head_hi: int
    tok_lo: int
    tok_hi: int

    @classmethod
    def open(cls, path: str | Path) -> KVFile:
        with safe_open(str(path), framework="pt") as f:
            m = f.metadata()
        return cls(str(path), int(m["head_lo"]), int(m["head_hi"]), int(m["tok_lo"]), int(m["tok_hi"]))

    def read(self, head_lo: int | None = None, head_hi: int | None = None) -> torch.Tensor:
        """[layers, 2, heads, tokens, head_dim] of heads [head_lo, head_hi) (default all in the file)."""
        with safe_open(self.path, framework="pt") as f:
            if head_lo is None:
                return f.get_tensor("kv")
            sl = f.get_slice("kv")
            return sl[:, :, head_lo - self.head_lo: (head_hi or self.head_hi) - self.head_lo]


def control(sock_path: str | Path, msg: dict, timeout: float = 30.0) -> dict:
    """Send one command to the scheduler-side connector and return its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(sock_path))
            s.sendall(json.dumps(msg).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                part = s.recv(65536)
                if not part:
                    break
                data += part
        except OSError as e:
            raise ExchangeError(f"vLLM's relayout connector did not answer at {sock_path}: {e}") from None
    try:
        out = json.loads(data)
    except ValueError:
        raise ExchangeError(f"vLLM's relayout connector sent an unreadable answer: {data[:200]!r}") from None
    if not out.get("ok"):
        raise ExchangeError(out.get("error") or "the connector refused", finished=out.get("finished") is True)
    return out
