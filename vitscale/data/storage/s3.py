"""``s3://bucket/prefix`` storage through boto3, against AWS or any S3-protocol endpoint.

The endpoint comes from ``endpoint_url=``, else ``VITSCALE_S3_ENDPOINT_URL``, else
``AWS_ENDPOINT_URL``, else AWS itself; credentials only ever come from boto3's standard chain.
botocore's own retries are switched off so that there is exactly one retry layer
(:mod:`vitscale.data.storage.retry`) and it also covers failures while a response *body* streams
(which botocore never retries). A missing object raises ``FileNotFoundError`` and a call that fails
for good raises :class:`StorageError`; both name the object as ``s3://bucket/key``.

Storage objects pickle (the boto3 client is rebuilt lazily), so data-loader workers can carry one.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

from vitscale.config.checks import check
from vitscale.config.errors import UserError
from vitscale.data.storage.base import ObjectReader, Storage, StorageError, check_name, is_name
from vitscale.data.storage.cleanup import after_error
from vitscale.data.storage.retry import RetryPolicy, ShortRead, call

__all__ = ["ENDPOINT_ENV_VARS", "S3Storage", "resolve_endpoint_url"]

log = logging.getLogger(__name__)
T = TypeVar("T")

ENDPOINT_ENV_VARS = ("VITSCALE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")


def resolve_endpoint_url(endpoint_url: str | None = None) -> str | None:
    """Explicit ``endpoint_url``, else ``$VITSCALE_S3_ENDPOINT_URL``, else ``$AWS_ENDPOINT_URL``."""
    if endpoint_url:
        return endpoint_url
    for var in ENDPOINT_ENV_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


_CLIENTS: dict[tuple[int, str | None, float], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _shared_client(endpoint_url: str | None, read_timeout_s: float) -> Any:
    """One boto3 S3 client per (process, endpoint, timeout).

    Building a client loads botocore's service model (~0.3 s), and clients are thread-safe, so
    storages share them. The pid is part of the key because connection pools must not cross fork.
    """
    key = (os.getpid(), endpoint_url, read_timeout_s)
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            import boto3
            from botocore.config import Config

            config = Config(
                # One retry layer (ours), which also covers body streaming.
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=10,
                read_timeout=read_timeout_s,
                max_pool_connections=32,
            )
            _CLIENTS[key] = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        return _CLIENTS[key]


class S3Storage(Storage):
    """A dataset under ``s3://bucket/prefix`` accessed through boto3 (any S3-protocol endpoint)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        retry: RetryPolicy | None = None,
        multipart_threshold: int = 64 * 1024 * 1024,
        multipart_chunksize: int = 16 * 1024 * 1024,
        read_timeout_s: float = 60.0,
    ) -> None:
        if not bucket:
            raise UserError("an s3:// url needs a bucket, e.g. s3://my-bucket/datasets/imagenet")
        check(multipart_chunksize >= 5 * 1024 * 1024, "multipart_chunksize",
              f"S3 multipart parts must be at least 5 MiB, got {multipart_chunksize} bytes")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = resolve_endpoint_url(endpoint_url)
        self.retry = retry or RetryPolicy.from_setting()  # the budget of $VITSCALE_S3_RETRY_S
        self.multipart_threshold = multipart_threshold
        self.multipart_chunksize = multipart_chunksize
        self.read_timeout_s = read_timeout_s
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r}, endpoint_url={self.endpoint_url!r})"

    # Pickle without the client or lock: each process builds its own.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        """The boto3 S3 client (built on first use; thread-safe to share)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = _shared_client(self.endpoint_url, self.read_timeout_s)
        return self._client

    def key_of(self, name: str) -> str:
        """The S3 key of ``name``."""
        check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def url_of(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key_of(name)}"

    def _retrying(self, what: str, name: str | None, fn: Callable[[], T]) -> T:
        """Run ``fn`` within this storage's retry policy (:func:`~vitscale.data.storage.retry.call`, the
        one retry loop); final errors name the object. ``name`` None means the dataset root (listing)."""
        return call(fn, self.retry, what, self.url_of(name) if name is not None else self.url)

    def _get(self, name: str, byte_range: str | None) -> bytes:
        """One GET including its body; a short body counts as a transient failure."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key_of(name)}
        if byte_range is not None:
            kwargs["Range"] = byte_range
        resp = self.client.get_object(**kwargs)
        body = resp["Body"]
        try:
            data = body.read()
        except BaseException as exc:  # the read's error decides the retry, not a failed close after it
            after_error(exc, "closing the response body", body.close)
            raise
        body.close()
        expected = resp.get("ContentLength")
        if expected is not None and len(data) != expected:
            raise ShortRead(f"got {len(data)} of {expected} bytes")
        return data

    def read_bytes(self, name: str) -> bytes:
        return self._retrying("read", name, lambda: self._get(name, None))

    def read_range(self, name: str, start: int, length: int) -> bytes:
        self._check_range(start, length)
        if length == 0:
            return b""
        rng = f"bytes={start}-{start + length - 1}"

        def get() -> bytes:
            try:
                return self._get(name, rng)
            except Exception as exc:
                # Start past the end: S3 answers 416; match local files and return b"".
                import botocore.exceptions as bce

                if isinstance(exc, bce.ClientError) and _status(exc) == 416:
                    return b""
                raise

        return self._retrying("read_range", name, get)

    def size(self, name: str) -> int:
        resp = self._retrying(
            "head",
            name,
            lambda: self.client.head_object(Bucket=self.bucket, Key=self.key_of(name)),
        )
        return int(resp["ContentLength"])

    def version(self, name: str) -> str:
        resp = self._retrying(
            "head",
            name,
            lambda: self.client.head_object(Bucket=self.bucket, Key=self.key_of(name)),
        )
        return f"{resp['ContentLength']} {resp.get('ETag', '')}"

    def open_read(self, name: str) -> BinaryIO:
        head = self._retrying(
            "head",
            name,
            lambda: self.client.head_object(Bucket=self.bucket, Key=self.key_of(name)),
        )
        raw = _S3RawStream(self, name, int(head["ContentLength"]), head.get("ETag"))
        return io.BufferedReader(raw, buffer_size=1024 * 1024)

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
            return True
        except FileNotFoundError:
            return False

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=self.multipart_chunksize,
            use_threads=True,
            max_concurrency=4,
        )

    def write_bytes(self, name: str, data: bytes) -> None:
        def put() -> None:
            if len(data) >= self.multipart_threshold:
                self.client.upload_fileobj(
                    io.BytesIO(data), self.bucket, self.key_of(name), Config=self._transfer_config()
                )
            else:
                self.client.put_object(Bucket=self.bucket, Key=self.key_of(name), Body=data)

        self._retrying("write", name, put)

    def write_file(self, name: str, local_path: str | os.PathLike[str]) -> None:
        # upload_file streams from disk and switches to multipart above the threshold, so a large
        # shard never has to sit in memory.
        self._retrying(
            "write",
            name,
            lambda: self.client.upload_file(
                os.fspath(local_path), self.bucket, self.key_of(name), Config=self._transfer_config()
            ),
        )

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        root = f"{self.prefix}/" if self.prefix else ""

        def go() -> dict[str, int]:
            sizes = {}
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=root + prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(root) :]
                    # Not files: the zero-byte folder markers some writers put (Ray Train puts `runs/exp/` when
                    # it starts a run; the S3 console's "create folder"), the root's own among them (""),
                    # and keys no local path can hold (`a/../b`).
                    if is_name(name):
                        sizes[name] = int(obj["Size"])
            return dict(sorted(sizes.items()))

        return self._listing(go)

    def holds_any(self, prefix: str) -> bool:
        root = f"{self.prefix}/" if self.prefix else ""
        return self._listing(lambda: bool(self.client.list_objects_v2(
            Bucket=self.bucket, Prefix=root + prefix, MaxKeys=1).get("KeyCount", 0)))

    def _listing(self, fn: Callable[[], T]) -> T:
        try:
            return self._retrying("list", None, fn)
        except FileNotFoundError as exc:
            # An S3 listing is never "not found": a prefix with nothing under it is an empty page, a missing
            # bucket NoSuchBucket. A bare 404 is a server that is no S3 (a web server, a wrong port or path),
            # and "no such object" would send the user looking for a dataset rather than at the endpoint.
            endpoint = f"the endpoint {self.endpoint_url}" if self.endpoint_url else "AWS's S3 endpoint"
            raise StorageError(f"list {self.url} failed: {endpoint} answered a listing with 404 Not Found, which "
                               f"no S3 server does: is it an S3 endpoint? (--endpoint-url, else "
                               f"${ENDPOINT_ENV_VARS[0]})", final=True) from exc

    def delete(self, name: str) -> None:
        self._retrying("delete", name,
                       lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key_of(name)))

    def rename(self, src: str, dst: str) -> None:
        # S3 has no rename: a server-side copy (multipart above 5 GB, done by boto3) then a delete.
        self._retrying("copy", src, lambda: self.client.copy(
            {"Bucket": self.bucket, "Key": self.key_of(src)}, self.bucket, self.key_of(dst),
            Config=self._transfer_config()))
        self.delete(src)


def _status(exc: BaseException | None) -> int | None:
    """The HTTP status of an S3 answer (boto3's ``ClientError``), or None for anything else."""
    response = getattr(exc, "response", None)
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None


class _S3RawStream(ObjectReader):
    """A seekable raw stream over one S3 object that resumes with a ranged GET after a drop.

    Every GET is pinned to the version the stream was opened on (``If-Match`` its ETag): a seek or a
    resumed drop is a new GET, and without the pin an object written again meanwhile (an export to the same
    URL, a re-copied shard) would be read as one stream spliced from two versions, at the same size, with
    no error. A changed object is a :class:`StorageError` instead."""

    def __init__(self, storage: S3Storage, name: str, size: int, etag: str | None = None) -> None:
        super().__init__(size)
        self._s = storage
        self._name = name
        self._etag = etag
        self._body: Any = None

    def _moved(self) -> None:
        self._drop_body()  # the open GET streams from the old position

    def _drop_body(self) -> None:
        if self._body is not None:
            try:
                self._body.close()
            except Exception as exc:  # noqa: BLE001 - closing a broken stream may itself fail
                log.debug("closing a broken body of %s: %r", self._name, exc)
            self._body = None

    def readinto(self, b: Any) -> int:
        if self._pos >= self._size or len(b) == 0:
            return 0
        want = min(len(b), self._size - self._pos)

        def chunk() -> bytes:
            try:
                if self._body is None:
                    pin = {"IfMatch": self._etag} if self._etag else {}
                    resp = self._s.client.get_object(
                        Bucket=self._s.bucket,
                        Key=self._s.key_of(self._name),
                        Range=f"bytes={self._pos}-",
                        **pin,
                    )
                    self._body = resp["Body"]
                data = self._body.read(want)
                if not data:
                    raise ShortRead(f"body ended at {self._pos} of {self._size} bytes")
                return data
            except BaseException:
                self._drop_body()  # resume from self._pos with a fresh ranged GET
                raise

        try:
            data = self._s._retrying("read", self._name, chunk)
        except StorageError as exc:
            if _status(exc.__cause__) == 412:  # If-Match failed: another write replaced the object
                raise StorageError(
                    f"read {self._s.url_of(self._name)}: the object was written again while it was being read "
                    "(its ETag changed); read it again once that write is done", final=True) from exc
            raise
        n = len(data)
        b[:n] = data
        self._pos += n
        return n

    def close(self) -> None:
        self._drop_body()
        super().close()
