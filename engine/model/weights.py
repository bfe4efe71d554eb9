"""Model references, weight loading (whole, filtered, sliced) and model fingerprints."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from relayout.engine.model.builtin import BUILTIN_NAMES, BUILTIN_VERSION, TRAINED_DIR, create_builtin
from relayout.storage.settings import settings
from safetensors import safe_open

BUILTIN_PREFIX = "builtin:"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_BLOCK = 8 << 20  # fingerprint read size


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_root() -> Path:
    return settings().cache


def resolve_model(ref: str | Path) -> Path:
    """``builtin:NAME`` → its generated directory (created once, shared by processes);
    anything else → an existing directory holding config.json."""
    ref_s = str(ref)
    if ref_s.startswith(BUILTIN_PREFIX):
        name = ref_s[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_NAMES:
            raise ModelNotFoundError(
                f"unknown builtin model {ref_s!r}; known: "
                + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES)
            )
        return _ensure_builtin(name)
    path = Path(ref_s).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {ref_s!r} is neither builtin:NAME ({', '.join(BUILTIN_NAMES)}) nor an existing directory"
        )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
    return path.resolve()


def _ensure_builtin(name: str) -> Path:
    # trained weights name the directory too: a cache made before (or with other) weights is not reused
    trained = TRAINED_DIR / f"{name}.safetensors"
    tag = f"-{xxhash.xxh64_hexdigest(trained.read_bytes())[:8]}" if trained.exists() else ""
    final = cache_root() / "models" / f"{name}-v{BUILTIN_VERSION}{tag}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private temp dir next to the target, then rename: the rename is atomic, so
    # a reader never sees a half-written model and concurrent creators simply race to it.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        create_builtin(name, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def weight_files(model_dir: Path) -> dict[str, str]:
    """Tensor name → safetensors file name (relative to model_dir)."""
    model_dir = Path(model_dir)
    for fname in (INDEX_FILE, SINGLE_FILE):
        p = model_dir / fname
        if p.is_file():
            st = p.stat()
            return dict(_weight_map(str(p), st.st_mtime_ns, st.st_size))
    raise ModelNotFoundError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


@functools.lru_cache(maxsize=64)
def _weight_map(path: str, _mtime_ns: int, _size: int) -> tuple[tuple[str, str], ...]:
    # Cached per file version: the loader asks once per tensor slice.
    if path.endswith(INDEX_FILE):
        return tuple(json.loads(Path(path).read_text())["weight_map"].items())
    with safe_open(path, framework="pt") as f:
        return tuple((k, SINGLE_FILE) for k in f.keys())


def load_weights(
    model_dir: Path,
    want: Callable[[str], bool] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Load the tensors whose names ``want`` accepts (all when None); files holding none of
    them are never opened, so a rank reads only its own experts."""
    model_dir = Path(model_dir)
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_files(model_dir).items():
        if want is None or want(name):
            by_file.setdefault(fname, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for fname, names in sorted(by_file.items()):
        with safe_open(model_dir / fname, framework="pt", device=str(device)) as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def load_weight_slice(
    model_dir: Path, name: str, dim: int, start: int, stop: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """``tensor[..., start:stop, ...]`` along ``dim``, reading only that slice from disk
    (tensor-parallel shards)."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    if name not in files:
        raise KeyError(f"{model_dir}: no tensor named {name!r}")
    with safe_open(model_dir / files[name], framework="pt", device=str(device)) as f:
        sl = f.get_slice(name)
        ndim = len(sl.get_shape())
        if dim < 0:
            dim += ndim
        if not 0 <= dim < ndim:
            raise IndexError(f"{name}: dim {dim} out of range for a {ndim}-d tensor")
        return sl[(slice(None),) * dim + (slice(start, stop),)]


_fp_cache: dict[tuple, str] = {}
_fp_lock = threading.Lock()


def _fingerprint_inputs(model_dir: Path) -> list[Path]:
    files = sorted(set(weight_files(model_dir).values()))
    return [model_dir / "config.json", *(model_dir / f for f in files)]


def model_identity(model_dir: Path) -> dict:
    """What two hosts compare, cheaply, to agree they load the same model: the canonical config
    and each weight file's name and size (the full fingerprint hashes every weight byte)."""
    model_dir = Path(model_dir).resolve()
    inputs = _fingerprint_inputs(model_dir)
    cfg = json.loads(inputs[0].read_text())
    cfg.pop("transformers_version", None)
    return {"config": cfg, "files": {p.name: p.stat().st_size for p in inputs[1:]}}


def model_fingerprint(model_dir: Path) -> str:
    """xxh3_128 hex of the canonical config plus the bytes of every weight file.

    ``transformers_version`` is left out of the config: it records who wrote the file, not
    what the model computes.
    """
    model_dir = Path(model_dir).resolve()
    inputs = _fingerprint_inputs(model_dir)
    key = (str(model_dir), *((p.name, st.st_mtime_ns, st.st_size) for p in inputs for st in [p.stat()]))
    with _fp_lock:
        if key in _fp_cache:
            return _fp_cache[key]
    cfg = json.loads(inputs[0].read_text())
    cfg.pop("transformers_version", None)
    h = xxhash.xxh3_128()
    h.update(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode())
    for p in inputs[1:]:
        h.update(f"\0{p.name}\0{p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            while block := f.read(_BLOCK):
                h.update(block)
    digest = h.hexdigest()
    with _fp_lock:
        _fp_cache[key] = digest
    return digest
