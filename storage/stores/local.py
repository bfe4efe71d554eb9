"""LocalStore: a checkpoint store on a local (or network) filesystem.

Layout: ``root/chunks/ab/<hash>``, ``root/manifests/<id>.json``, temps in ``root/tmp``.
Every file is written to a temp file, fsynced and renamed into place, so readers never
see partial files; the manifest is renamed last (after the chunk directories are
fsynced), which is the commit point.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from relayout.storage.errors import CheckpointNotFound, ChunkMissing
from relayout.storage.stores.base import HASH_RE, Store, check_hash, check_id


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.realpath(root))
        self.identity = f"file://{self.root}"
        self._chunks = self.root / "chunks"
        self._manifests = self.root / "manifests"
        self._tmp = self.root / "tmp"
        for d in (self._chunks, self._manifests, self._tmp):
            d.mkdir(parents=True, exist_ok=True)
        # Chunk directories with renames not yet fsynced; flushed before a manifest commit
        # so a crash can never leave a committed manifest pointing at lost chunks.
        self._dirty: set[Path] = set()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _chunk_path(self, h: str) -> Path:
        return self._chunks / check_hash(h)[:2] / h

    def _manifest_path(self, checkpoint_id: str) -> Path:
        return self._manifests / f"{check_id(checkpoint_id)}.json"

    def _write_atomic(self, dest: Path, data: bytes) -> None:
        tmp = self._tmp / f"{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # ---- chunks -----------------------------------------------------------------------
    def has_chunk(self, h: str) -> bool:
        return self._chunk_path(h).is_file()

    def _put_chunk_new(self, h: str, data: bytes) -> None:
        dest = self._chunk_path(h)
        dest.parent.mkdir(exist_ok=True)
        self._write_atomic(dest, data)
        self._dirty.add(dest.parent)

    def _touch_chunk(self, h: str) -> None:
        try:
            os.utime(self._chunk_path(h))
        except FileNotFoundError:
            pass

    def get_chunk(self, h: str) -> bytes:
        try:
            return self._chunk_path(h).read_bytes()
        except FileNotFoundError:
            raise ChunkMissing(f"chunk {h} not found in {self.root}") from None

    def _iter_chunks(self) -> Iterator[tuple[str, float]]:
        for sub in self._chunks.iterdir():
            if not sub.is_dir():
                continue
            for p in sub.iterdir():
                if not HASH_RE.fullmatch(p.name):
                    continue  # stray file, not a chunk
                try:
                    yield p.name, p.stat().st_mtime
                except FileNotFoundError:
                    continue

    def _delete_chunk(self, h: str) -> None:
        self._chunk_path(h).unlink(missing_ok=True)

    # ---- manifests ----------------------------------------------------------------------
    def put_manifest(self, checkpoint_id: str, data: bytes) -> None:
        dest = self._manifest_path(checkpoint_id)
        for d in list(self._dirty):
            _fsync_dir(d)
            self._dirty.discard(d)
        _fsync_dir(self._chunks)
        self._write_atomic(dest, data)
        _fsync_dir(self._manifests)

    def get_manifest(self, checkpoint_id: str) -> bytes:
        try:
            return self._manifest_path(checkpoint_id).read_bytes()
        except FileNotFoundError:
            raise CheckpointNotFound(f"checkpoint {checkpoint_id} not found in {self.root}") from None

    def list_checkpoints(self) -> list[str]:
        out = []
        for p in self._manifests.glob("*.json"):
            try:
                out.append(check_id(p.name[: -len(".json")]))
            except ValueError:
                continue  # stray file, not ours
        return sorted(out)

    def _delete_manifest(self, checkpoint_id: str) -> None:
        self._manifest_path(checkpoint_id).unlink(missing_ok=True)
        _fsync_dir(self._manifests)

    def _cleanup_partial(self, older_than: float) -> int:
        removed = 0
        for p in self._tmp.iterdir():
            try:
                if p.stat().st_mtime < older_than:
                    p.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed
