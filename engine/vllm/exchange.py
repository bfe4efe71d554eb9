"""What relayout's vLLM connector and the replica process in front of vLLM hand each other: KV files
in the replica's exchange directory (tmpfs where there is one) and one JSON line per command on a Unix
socket in it.

No vLLM import here: the replica process reads and writes these without loading vLLM.

- An **export** (a cut of running requests): the replica asks the scheduler-side connector over the
  socket; it resolves each request's blocks at the next step and every worker writes
  `rank{r}.safetensors` into the export's directory: one tensor `kv` [layers, 2, local KV heads,
  tokens, head_dim] of tokens [tok_lo, tok_hi), its head range and token range in the metadata.
- A **load** (a session arriving): the replica writes one file per arrived token range, all KV heads,
  and names them in the request's `kv_transfer_params`; the workers copy each rank's heads of them
  into the request's blocks before the step that would compute those tokens.

The exchange is locked: `kv_transfer_params` come from whoever can reach vLLM's port, so the
connector acts only on parameters signed with the replica's per-launch secret (an HMAC over the
session, its load and a nonce used once; the secret lies in a file only the replica's user can
read), and it opens only plain files directly inside the exchange directory, each checked against
the hash the replica recorded when it wrote it."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

SESSION_KEY = "relayout_session"  # kv_transfer_params: the relayout session a vLLM request serves
LOAD_KEY = "relayout_load"  # kv_transfer_params: {"id", "tokens", "files": [{name, tok_lo, tok_hi, hash}]}
NONCE_KEY = "relayout_nonce"  # kv_transfer_params: used once: a signed body cannot be replayed
SIG_KEY = "relayout_sig"  # kv_transfer_params: HMAC-SHA256 of the three above under the exchange's secret
SECRET_FILE = "secret"
CONTROL_SOCKET = "control.sock"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a file directly inside the exchange


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


@dataclass(frozen=True)
class Exchange:
    """A replica's exchange directory (mode 0700) and the secret in it (mode 0600)."""

    dir: Path
    secret: bytes

    @classmethod
    def create(cls, root: Path | None = None) -> Exchange:
        d = Path(tempfile.mkdtemp(prefix="relayout-vllm-", dir=root or staging_root()))  # 0700
        return cls.init(d)

    @classmethod
    def init(cls, d: Path) -> Exchange:
        """Make `d` an exchange (a new secret each launch: parameters signed for another are refused)."""
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = secrets.token_hex(32)
        fd = os.open(d / SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        return cls(d, key.encode())

    @classmethod
    def ensure(cls, d: Path) -> Exchange:
        """`d` as an exchange: its secret kept when it has one (a vLLM started with it still reads it)."""
        return cls.open(d) if (d / SECRET_FILE).exists() else cls.init(d)

    @classmethod
    def open(cls, d: str | Path) -> Exchange:
        d = Path(d)
        try:
            key = (d / SECRET_FILE).read_text().strip()
        except OSError as e:
            raise ExchangeError(f"exchange directory {d} has no readable {SECRET_FILE}: {e}") from None
        if len(key) < 32:
            raise ExchangeError(f"exchange directory {d}: its {SECRET_FILE} is too short to be one relayout wrote")
        return cls(d, key.encode())

    @property
    def control_socket(self) -> Path:
        return self.dir / CONTROL_SOCKET

    def path(self, name: str) -> Path:
        """`name` as a plain file directly inside the exchange; ExchangeError for anything else (a path,
        `..`, a link, a device). The caller opens what this returns."""
        if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name == SECRET_FILE:
            raise ExchangeError(f"{name!r} is not a file name of this exchange")
        p = self.dir / name
        try:
            st = os.lstat(p)
        except OSError as e:
            raise ExchangeError(f"staged file {name} is missing: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise ExchangeError(f"staged file {name} is not a regular file")
        return p

    def new_dir(self, prefix: str) -> Path:
        d = self.dir / f"{prefix}{uuid.uuid4().hex}"
        d.mkdir(mode=0o700)
        return d

    # ---- signed kv_transfer_params -------------------------------------------------------------
    def _mac(self, session: str, load: dict | None, nonce: str) -> str:
        body = json.dumps([session, load, nonce], sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self.secret, body, hashlib.sha256).hexdigest()

    def transfer_params(self, session: str, load: dict | None = None) -> dict:
        nonce = secrets.token_hex(16)
        params = {SESSION_KEY: session, NONCE_KEY: nonce, SIG_KEY: self._mac(session, load, nonce)}
        if load:
            params[LOAD_KEY] = load
        return params

    def verified(self, params: dict | None) -> tuple[str, dict | None, str] | None:
        """(session, load, nonce) of parameters this exchange signed, else None (any client may send any)."""
        if not isinstance(params, dict):
            return None
        sid, load, nonce, sig = (params.get(k) for k in (SESSION_KEY, LOAD_KEY, NONCE_KEY, SIG_KEY))
        if not (isinstance(sid, str) and isinstance(nonce, str) and isinstance(sig, str)):
            return None
        if load is not None and not isinstance(load, dict):
            return None
        if not hmac.compare_digest(sig, self._mac(sid, load, nonce)):
            return None
        return sid, load, nonce

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def file_hash(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def write_kv(path: Path | str, kv: torch.Tensor, head_lo: int, head_hi: int, tok_lo: int, tok_hi: int) -> str:
    """One KV file, visible only once complete (rename): `kv` is [layers, 2, heads, tokens, head_dim].
    Returns the hash of its bytes (what a reader checks them against)."""
    path = Path(path)
    data = save_bytes({"kv": kv.contiguous()}, metadata={"head_lo": str(head_lo), "head_hi": str(head_hi),
                                                          "tok_lo": str(tok_lo), "tok_hi": str(tok_hi)})
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return file_hash(data)


def read_kv(path: Path, expect_hash: str | None = None) -> tuple[torch.Tensor, dict[str, str]]:
    """A KV file's tensor and metadata, its bytes checked against `expect_hash` (ExchangeError if not)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ExchangeError(f"staged file {path.name} cannot be read: {e.strerror}") from None
    if expect_hash is not None and not hmac.compare_digest(file_hash(data), str(expect_hash)):
        raise ExchangeError(f"staged file {path.name} does not match its hash ({len(data)} bytes): damaged")
    try:
        (n,) = struct.unpack_from("<Q", data)  # safetensors: an 8-byte header length, then its JSON header
        meta = json.loads(bytes(data[8: 8 + n])).get("__metadata__") or {}
        kv = load_bytes(data)["kv"]
    except Exception as e:  # noqa: BLE001 - any parse failure is a damaged file
        raise ExchangeError(f"staged file {path.name} is not a KV file: {type(e).__name__}: {e}") from None
    return kv, meta


def damage_staged(exchange_dir: Path, entry: dict, fault: str) -> dict:
    """A staged file damaged as a disk or a hand could (RELAYOUT_VLLM_STAGE_FAULT, for fault tests):
    `missing`, `truncate`, `shape` (another file's shape under its own hash) or `hash` (one byte off)."""
    path = exchange_dir / entry["name"]
    if fault == "missing":
        path.unlink()
    elif fault == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif fault == "shape":
        kv, meta = read_kv(path)
        entry = {**entry, "hash": write_kv(path, kv[:, :, :, :-1].contiguous(), int(meta["head_lo"]),
                                           int(meta["head_hi"]), entry["tok_lo"], entry["tok_hi"])}
    elif fault == "hash":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    return entry


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
