"""Where datasets live: a local folder or an ``s3://bucket/prefix``, behind one small interface.

``open_storage(url)`` returns a :class:`Storage` whose names are relative to the dataset root
(``"train-000000.tar"``, ``"_index.parquet"``). Both back ends offer the same calls:

- ``read_bytes(name)``, ``read_range(name, start, length)``, ``open_read(name)`` (a seekable,
  buffered binary stream), ``size(name)``;
- ``write_bytes(name, data)``, ``write_file(name, local_path)`` (multipart upload on S3 for large
  shards), ``exists(name)``, ``list(prefix="")``, ``url_of(name)``.

Modules: :mod:`~vitscale.data.storage.base` (the interface), :mod:`~vitscale.data.storage.local`
(folders), :mod:`~vitscale.data.storage.s3` (boto3) and :mod:`~vitscale.data.storage.retry` (the
one retry layer for object stores). This module only picks the back end for a url.
"""

from __future__ import annotations

from vitscale.config.errors import UserError
from vitscale.config.location import canonical_location
from vitscale.data.storage.base import Storage, StorageError
from vitscale.data.storage.local import LocalStorage
from vitscale.data.storage.retry import RetryPolicy
from vitscale.data.storage.s3 import ENDPOINT_ENV_VARS, S3Storage, resolve_endpoint_url

__all__ = [
    "ENDPOINT_ENV_VARS",
    "LocalStorage",
    "RetryPolicy",
    "S3Storage",
    "Storage",
    "StorageError",
    "open_storage",
    "resolve_endpoint_url",
]


def open_storage(
    url: str, *, endpoint_url: str | None = None, retry: RetryPolicy | None = None, key: str = "storage location"
) -> Storage:
    """Open ``url``: ``s3://bucket/prefix`` (S3 via boto3) or a local folder (``file://`` optional).

    ``url`` goes through the one spelling of a location (`config.location.canonical_location`): one it
    refuses (`s3:/bar`, a bucket name S3 refuses, another scheme) is a ``ConfigError`` naming ``key``.
    ``endpoint_url`` points S3 at another S3-protocol server (MinIO, moto, Ceph); without it the
    environment variables ``VITSCALE_S3_ENDPOINT_URL`` then ``AWS_ENDPOINT_URL`` are consulted.
    """
    if not isinstance(url, str) or not url:
        raise UserError(f"a dataset url must be a non-empty string, got {url!r}")
    url = canonical_location(url, key)
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://") :].partition("/")
        return S3Storage(bucket, prefix, endpoint_url=endpoint_url, retry=retry)
    return LocalStorage(url)
