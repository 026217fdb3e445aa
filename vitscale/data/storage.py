"""Where datasets live: a local folder or an ``s3://bucket/prefix``, behind one small interface.

``open_storage(url)`` returns a :class:`Storage` whose names are relative to the dataset root
(``"train-000000.tar"``, ``"_index.parquet"``). Both back ends offer the same calls:

- ``read_bytes(name)``, ``read_range(name, start, length)``, ``open_read(name)`` (a seekable,
  buffered binary stream), ``size(name)``;
- ``write_bytes(name, data)``, ``write_file(name, local_path)`` (multipart upload on S3 for large
  shards), ``exists(name)``, ``list(prefix="")``, ``url_of(name)``.

S3 goes through boto3. The endpoint comes from ``endpoint_url=``, else ``VITSCALE_S3_ENDPOINT_URL``,
else ``AWS_ENDPOINT_URL``, else AWS itself; credentials only ever come from boto3's standard chain.
Transient failures (HTTP 5xx, throttling, dropped connections, read timeouts, short bodies) are
retried with exponential backoff and full jitter for a bounded number of attempts. botocore's own
retries are switched off so that there is exactly one retry layer and it also covers failures while
a response *body* streams (which botocore never retries). A missing object raises
``FileNotFoundError`` and a read that fails for good raises :class:`StorageError`; both name the
object as ``s3://bucket/key``.

Storage objects pickle (the boto3 client is rebuilt lazily), so data-loader workers can carry one.
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, TypeVar

__all__ = [
    "RetryPolicy",
    "Storage",
    "LocalStorage",
    "S3Storage",
    "StorageError",
    "open_storage",
    "resolve_endpoint_url",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

ENDPOINT_ENV_VARS = ("VITSCALE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")

# S3 error codes that mean "try again later" even when the HTTP status is not 5xx.
_TRANSIENT_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "SlowDown",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "PriorRequestNotComplete",
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound", "NoSuchBucket"})


class StorageError(OSError):
    """A storage operation failed for good (after retries, or with a non-transient error)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter for transient object-store errors."""

    max_attempts: int = 8
    """Total tries per operation, the first one included."""
    base_delay_s: float = 0.05
    """Upper bound of the first backoff; doubles per attempt (full jitter draws in [0, bound])."""
    max_delay_s: float = 5.0
    """Cap on any single backoff."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("RetryPolicy delays must be >= 0")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        bound = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
        return (rng or random).uniform(0.0, bound)


class Storage:
    """Interface shared by the local and S3 back ends; names are relative to the dataset root."""

    url: str

    def read_bytes(self, name: str) -> bytes:
        """The whole object ``name``."""
        raise NotImplementedError

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from byte ``start`` (fewer only at end of object)."""
        raise NotImplementedError

    def open_read(self, name: str) -> BinaryIO:
        """A buffered, seekable binary stream over ``name``; close it when done."""
        raise NotImplementedError

    def size(self, name: str) -> int:
        """Object size in bytes."""
        raise NotImplementedError

    def write_bytes(self, name: str, data: bytes) -> None:
        """Create or replace ``name`` with ``data`` (atomically for readers)."""
        raise NotImplementedError

    def write_file(self, name: str, local_path: str | os.PathLike[str]) -> None:
        """Upload or copy the local file ``local_path`` to ``name`` (multipart on S3 when large)."""
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        """Whether object ``name`` exists."""
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[str]:
        """Sorted names (relative to the root) starting with ``prefix``."""
        raise NotImplementedError

    def url_of(self, name: str) -> str:
        """A full address of ``name`` for messages and other tools."""
        raise NotImplementedError

    def _check_range(self, start: int, length: int) -> None:
        if start < 0 or length < 0:
            raise ValueError(f"read_range needs start >= 0 and length >= 0, got {start}, {length}")


def _check_name(name: str) -> str:
    if not name or name.startswith("/") or any(p in ("..", ".") for p in name.split("/")):
        raise ValueError(f"storage names are relative paths without '.'/'..', got {name!r}")
    return name


def _create_part_file(path: Path) -> tuple[int, str]:
    """Create a hidden sibling ``.NAME.<random>.part`` for an atomic write-then-rename.

    Unlike ``mkstemp`` (always 0600) this honours the umask, so finished files get the usual
    permissions of the folder's other files.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{os.urandom(6).hex()}.part"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), str(tmp)
        except FileExistsError:
            continue
    raise StorageError(f"cannot create a temporary file next to {path}")


class LocalStorage(Storage):
    """A dataset in a local folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    def _path(self, name: str) -> Path:
        return self.root / _check_name(name)

    def read_bytes(self, name: str) -> bytes:
        return self._path(name).read_bytes()

    def read_range(self, name: str, start: int, length: int) -> bytes:
        self._check_range(start, length)
        with open(self._path(name), "rb") as f:
            f.seek(start)
            return f.read(length)

    def open_read(self, name: str) -> BinaryIO:
        return open(self._path(name), "rb")

    def size(self, name: str) -> int:
        return self._path(name).stat().st_size

    def write_bytes(self, name: str, data: bytes) -> None:
        path = self._path(name)
        # Write then rename so a reader never sees a half-written shard or index.
        fd, tmp = _create_part_file(path)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def write_file(self, name: str, local_path: str | os.PathLike[str]) -> None:
        path = self._path(name)
        fd, tmp = _create_part_file(path)
        os.close(fd)
        try:
            shutil.copyfile(local_path, tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def list(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        names = []
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                if f.endswith(".part") and f.startswith("."):
                    continue  # an in-flight atomic write
                rel = Path(dirpath, f).relative_to(self.root).as_posix()
                if rel.startswith(prefix):
                    names.append(rel)
        return sorted(names)

    def url_of(self, name: str) -> str:
        return str(self._path(name))


def resolve_endpoint_url(endpoint_url: str | None = None) -> str | None:
    """Explicit ``endpoint_url``, else ``$VITSCALE_S3_ENDPOINT_URL``, else ``$AWS_ENDPOINT_URL``."""
    if endpoint_url:
        return endpoint_url
    for var in ENDPOINT_ENV_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


def _is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying: 5xx, throttling, dropped connections, short reads.

    Wrappers such as boto3's ``S3UploadFailedError`` (raised by managed uploads) are judged by
    the error they wrap.
    """
    from boto3.exceptions import S3UploadFailedError

    if isinstance(exc, S3UploadFailedError):
        inner = exc.__cause__ or exc.__context__
        # Without a chained cause the message is all we have; managed uploads mostly fail on
        # the network, so treat it as transient (attempts stay bounded).
        return True if inner is None else _is_transient(inner)
    return _is_transient_leaf(exc)


def _is_transient_leaf(exc: BaseException) -> bool:
    import botocore.exceptions as bce
    import urllib3.exceptions as u3e

    if isinstance(exc, bce.ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
        code = str(err.get("Code", ""))
        return status >= 500 or status == 429 or code in _TRANSIENT_CODES or code.startswith("5")
    return isinstance(
        exc,
        (
            bce.ConnectionError,  # endpoint unreachable, connect timeout, proxy, SSL
            bce.HTTPClientError,  # connection closed, read timeout, response streaming error
            bce.IncompleteReadError,
            u3e.HTTPError,  # protocol errors while streaming a body
            http.client.IncompleteRead,
            http.client.RemoteDisconnected,
            ConnectionError,  # builtin: reset/aborted/refused
            TimeoutError,
            _ShortRead,
        ),
    )


def _is_missing(exc: BaseException) -> bool:
    import botocore.exceptions as bce

    if isinstance(exc, bce.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return code in _MISSING_CODES or status == 404
    return False


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


class _ShortRead(Exception):
    """A body ended before the length the server announced (a dropped connection in disguise)."""


class S3Storage(Storage):
    """A dataset under ``s3://bucket/prefix`` accessed through boto3 (any S3-protocol endpoint)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        retry: RetryPolicy = RetryPolicy(),
        multipart_threshold: int = 64 * 1024 * 1024,
        multipart_chunksize: int = 16 * 1024 * 1024,
        read_timeout_s: float = 60.0,
    ) -> None:
        if not bucket:
            raise ValueError("an s3:// url needs a bucket, e.g. s3://my-bucket/datasets/imagenet")
        if multipart_chunksize < 5 * 1024 * 1024:
            raise ValueError("S3 multipart parts must be at least 5 MiB (multipart_chunksize)")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = resolve_endpoint_url(endpoint_url)
        self.retry = retry
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
        _check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def url_of(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key_of(name)}"

    def _retrying(self, what: str, name: str | None, fn: Callable[[], T]) -> T:
        """Run ``fn`` with bounded backoff on transient errors; final errors name the object.

        ``name`` None means the dataset root itself (listing).
        """
        where = self.url_of(name) if name is not None else self.url
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                if _is_missing(exc):
                    raise FileNotFoundError(f"{what}: no such object {where}") from exc
                if not _is_transient(exc):
                    raise StorageError(f"{what} {where} failed: {exc!r}") from exc
                if attempt >= self.retry.max_attempts:
                    raise StorageError(f"{what} {where} failed after {attempt} attempts: {exc!r}") from exc
                delay = self.retry.delay(attempt)
                log.debug("%s %s: transient %r, retry %d in %.2fs", what, name, exc, attempt, delay)
                time.sleep(delay)

    def _get(self, name: str, byte_range: str | None) -> bytes:
        """One GET including its body; a short body counts as a transient failure."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key_of(name)}
        if byte_range is not None:
            kwargs["Range"] = byte_range
        resp = self.client.get_object(**kwargs)
        body = resp["Body"]
        try:
            data = body.read()
        finally:
            body.close()
        expected = resp.get("ContentLength")
        if expected is not None and len(data) != expected:
            raise _ShortRead(f"got {len(data)} of {expected} bytes")
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

                if isinstance(exc, bce.ClientError) and exc.response.get(
                    "ResponseMetadata", {}
                ).get("HTTPStatusCode") == 416:
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

    def open_read(self, name: str) -> BinaryIO:
        raw = _S3RawStream(self, name, self.size(name))
        return io.BufferedReader(raw, buffer_size=1024 * 1024)  # type: ignore[return-value]

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
        root = f"{self.prefix}/" if self.prefix else ""

        def go() -> list[str]:
            names = []
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=root + prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    names.append(obj["Key"][len(root) :])
            return sorted(names)

        return self._retrying("list", None, go)


class _S3RawStream(io.RawIOBase):
    """A seekable raw stream over one S3 object that resumes with a ranged GET after a drop."""

    def __init__(self, storage: S3Storage, name: str, size: int) -> None:
        self._s = storage
        self._name = name
        self._size = size
        self._pos = 0
        self._body: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        new = base + offset
        if new < 0:
            raise ValueError(f"negative seek position {new}")
        if new != self._pos:
            self._drop_body()
            self._pos = new
        return self._pos

    def _drop_body(self) -> None:
        if self._body is not None:
            try:
                self._body.close()
            except Exception:  # noqa: BLE001 - closing a broken stream may itself fail
                pass
            self._body = None

    def readinto(self, b: Any) -> int:
        if self._pos >= self._size or len(b) == 0:
            return 0
        want = min(len(b), self._size - self._pos)

        def chunk() -> bytes:
            try:
                if self._body is None:
                    resp = self._s.client.get_object(
                        Bucket=self._s.bucket,
                        Key=self._s.key_of(self._name),
                        Range=f"bytes={self._pos}-",
                    )
                    self._body = resp["Body"]
                data = self._body.read(want)
                if not data:
                    raise _ShortRead(f"body ended at {self._pos} of {self._size} bytes")
                return data
            except BaseException:
                self._drop_body()  # resume from self._pos with a fresh ranged GET
                raise

        data = self._s._retrying("read", self._name, chunk)
        n = len(data)
        b[:n] = data
        self._pos += n
        return n

    def close(self) -> None:
        self._drop_body()
        super().close()


def open_storage(
    url: str, *, endpoint_url: str | None = None, retry: RetryPolicy | None = None
) -> Storage:
    """Open ``url``: ``s3://bucket/prefix`` (S3 via boto3) or a local folder (``file://`` optional).

    ``endpoint_url`` points S3 at another S3-protocol server (MinIO, moto, Ceph); without it the
    environment variables ``VITSCALE_S3_ENDPOINT_URL`` then ``AWS_ENDPOINT_URL`` are consulted.
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"a dataset url must be a non-empty string, got {url!r}")
    if url.startswith("s3://"):
        rest = url[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        return S3Storage(bucket, prefix, endpoint_url=endpoint_url, retry=retry or RetryPolicy())
    if "://" in url and not url.startswith("file://"):
        raise ValueError(f"unsupported dataset url {url!r}: use a local path, file:// or s3://")
    return LocalStorage(url[len("file://") :] if url.startswith("file://") else url)
