"""S3Store: a checkpoint store in an S3 (or S3-compatible) bucket.

Keys: ``<prefix>/chunks/ab/<hash>``, ``<prefix>/manifests/<id>.json``. S3 objects become
visible atomically when their PUT (or multipart completion) succeeds, so chunks are
uploaded first and the manifest PUT is the commit. The client is created the standard
boto3 way, so credentials, region and ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
come from the environment; nothing S3-specific is hard-coded.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError
from relayout.storage.errors import CheckpointNotFound, ChunkMissing, StorageError
from relayout.storage.stores.base import HASH_RE, Store, check_hash, check_id

DEFAULT_MULTIPART_THRESHOLD = 64 * 1024 * 1024
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}


def _is_not_found(exc: ClientError) -> bool:
    return str(exc.response.get("Error", {}).get("Code")) in _NOT_FOUND


class S3Store(Store):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        client: Any | None = None,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        multipart_chunksize: int | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client if client is not None else boto3.client("s3")
        self.identity = f"s3://{bucket}/{self.prefix}"
        # S3 requires parts >= 5 MiB (except the last); large parts upload concurrently.
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize or max(multipart_threshold, 5 * 1024 * 1024),
        )

    def __repr__(self) -> str:
        return f"S3Store({self.bucket!r}, {self.prefix!r})"

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _chunk_key(self, h: str) -> str:
        return self._key(f"chunks/{check_hash(h)[:2]}/{h}")

    def _manifest_key(self, checkpoint_id: str) -> str:
        return self._key(f"manifests/{check_id(checkpoint_id)}.json")

    def _call(self, what: str, fn: Any, **kw: Any) -> Any:
        try:
            return fn(**kw)
        except ClientError:
            raise
        except BotoCoreError as exc:
            raise StorageError(f"S3 {what} failed for s3://{self.bucket}/{kw.get('Key', '')}: {exc}") from None

    def _list(self, rel_prefix: str) -> Iterator[dict[str, Any]]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(rel_prefix)):
                yield from page.get("Contents", [])
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"S3 list of s3://{self.bucket}/{self._key(rel_prefix)} failed: {exc}") from None

    # ---- chunks -------------------------------------------------------------------------
    def has_chunk(self, h: str) -> bool:
        try:
            self._call("head", self.client.head_object, Bucket=self.bucket, Key=self._chunk_key(h))
            return True
        except ClientError as exc:
            if _is_not_found(exc):
                return False
            raise StorageError(f"S3 head of chunk {h} failed: {exc}") from None

    def _put_chunk_new(self, h: str, data: bytes) -> None:
        try:
            # upload_fileobj switches to a concurrent multipart upload above the threshold.
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, self._chunk_key(h), Config=self.transfer)
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"S3 upload of chunk {h} failed: {exc}") from None

    def get_chunk(self, h: str) -> bytes:
        key = self._chunk_key(h)
        buf = io.BytesIO()
        try:
            # download_fileobj fetches large objects as concurrent ranged GETs.
            self.client.download_fileobj(self.bucket, key, buf, Config=self.transfer)
            return buf.getvalue()
        except BotoCoreError as exc:
            raise StorageError(f"S3 get of chunk {h} failed: {exc}") from None
        except ClientError as exc:
            if _is_not_found(exc):
                raise ChunkMissing(f"chunk {h} not found at s3://{self.bucket}/{key}") from None
            raise StorageError(f"S3 get of chunk {h} failed: {exc}") from None

    def _iter_chunks(self) -> Iterator[tuple[str, float]]:
        for obj in self._list("chunks/"):
            name = obj["Key"].rsplit("/", 1)[-1]
            if HASH_RE.fullmatch(name):
                yield name, obj["LastModified"].timestamp()

    def _delete_chunk(self, h: str) -> None:
        try:
            self._call("delete", self.client.delete_object, Bucket=self.bucket, Key=self._chunk_key(h))
        except ClientError as exc:
            raise StorageError(f"S3 delete of chunk {h} failed: {exc}") from None

    # ---- manifests ------------------------------------------------------------------------
    def put_manifest(self, checkpoint_id: str, data: bytes) -> None:
        key = self._manifest_key(checkpoint_id)
        try:
            self._call("put", self.client.put_object, Bucket=self.bucket, Key=key, Body=data,
                       ContentType="application/json")
        except ClientError as exc:
            raise StorageError(f"S3 put of manifest {checkpoint_id} failed: {exc}") from None

    def get_manifest(self, checkpoint_id: str) -> bytes:
        key = self._manifest_key(checkpoint_id)
        try:
            return self._call("get", self.client.get_object, Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if _is_not_found(exc):
                raise CheckpointNotFound(f"checkpoint {checkpoint_id} not found at s3://{self.bucket}/{key}") from None
            raise StorageError(f"S3 get of manifest {checkpoint_id} failed: {exc}") from None

    def list_checkpoints(self) -> list[str]:
        out = []
        for obj in self._list("manifests/"):
            name = obj["Key"].rsplit("/", 1)[-1]
            if name.endswith(".json"):
                try:
                    out.append(check_id(name[: -len(".json")]))
                except ValueError:
                    continue
        return sorted(out)

    def _delete_manifest(self, checkpoint_id: str) -> None:
        try:
            self._call("delete", self.client.delete_object, Bucket=self.bucket, Key=self._manifest_key(checkpoint_id))
        except ClientError as exc:
            raise StorageError(f"S3 delete of manifest {checkpoint_id} failed: {exc}") from None

    def _cleanup_partial(self, older_than: float) -> int:
        """Abort multipart uploads under our prefix that were started before the cutoff."""
        removed = 0
        try:
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key("chunks/")):
                for up in page.get("Uploads", []):
                    if up["Initiated"].timestamp() < older_than:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                        removed += 1
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"S3 multipart cleanup in s3://{self.bucket} failed: {exc}") from None
        return removed
