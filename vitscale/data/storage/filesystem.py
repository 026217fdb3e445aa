"""The pyarrow filesystem Ray Train persists a run's checkpoints through, with bounded retries.

Ray Train copies every reported checkpoint into ``storage_path/run_name`` with
``pyarrow.fs.copy_files``. Left to itself it builds an S3 filesystem from the URL with the AWS
SDK's defaults; here it is built once with an explicit retry strategy
(``AwsStandardS3RetryStrategy``: exponential backoff with jitter, for throttling (503 SlowDown),
5xx answers and dropped or reset connections) and timeouts, so a flaky object store costs a few
retried requests and a dead one ends the upload after ``max_attempts`` tries with the SDK's last
error, instead of hanging. The endpoint comes from ``endpoint_url``, else
``VITSCALE_S3_ENDPOINT_URL``, else ``AWS_ENDPOINT_URL`` (as for datasets); credentials from the AWS
SDK's standard chain.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any
from urllib.parse import urlparse

from vitscale.data.storage.s3 import resolve_endpoint_url

__all__ = ["CHECKPOINT_MAX_ATTEMPTS", "run_filesystem"]

CHECKPOINT_MAX_ATTEMPTS = 10
"""Tries per request of a checkpoint upload, the first one included."""


def run_filesystem(storage_path: str, *, endpoint_url: str | None = None,
                   max_attempts: int = CHECKPOINT_MAX_ATTEMPTS, connect_timeout_s: float = 10.0,
                   request_timeout_s: float = 120.0) -> tuple[Any, str]:
    """``(storage_filesystem, storage_path)`` for Ray's ``RunConfig``: ``(None, storage_path)`` for a
    local or NFS folder (Ray's default), a retrying ``pyarrow.fs.S3FileSystem`` and the path without
    its ``s3://`` for object storage (Ray wants the bare path beside a filesystem)."""
    if not storage_path.startswith("s3://"):
        return None, storage_path
    import pyarrow.fs

    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    kwargs: dict[str, Any] = {
        "retry_strategy": pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=max_attempts),
        "connect_timeout": connect_timeout_s,
        "request_timeout": request_timeout_s,
    }
    endpoint = resolve_endpoint_url(endpoint_url)
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs.update(endpoint_override=parsed.netloc + parsed.path.rstrip("/"), scheme=parsed.scheme or "https")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    bucket = storage_path[len("s3://"):].split("/", 1)[0]
    if region:
        kwargs["region"] = region
    elif not endpoint:
        with contextlib.suppress(OSError):  # what pyarrow's FileSystem.from_uri does for Ray by default
            kwargs["region"] = pyarrow.fs.resolve_s3_region(bucket)
    return pyarrow.fs.S3FileSystem(**kwargs), storage_path[len("s3://"):].rstrip("/")
