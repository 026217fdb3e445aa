"""The pyarrow filesystem Ray Train persists a run's checkpoints through, with bounded retries.

Ray Train copies every reported checkpoint into ``storage_path/run_name`` with
``pyarrow.fs.copy_files`` (in object storage as vitscale's ``checkpoint_upload_fn``, :func:`copy_folder`,
which Ray does not retry on top of the filesystem's tries). Left to itself it builds an S3 filesystem from
the URL with the AWS SDK's defaults; here it is built once with an explicit retry strategy
(``AwsStandardS3RetryStrategy``: exponential backoff with jitter, for throttling (503 SlowDown),
5xx answers and dropped or reset connections; refusals such as 403 are not retried) and timeouts.
pyarrow takes no retry rule of ours, so its number of tries is derived from the one retry budget
(``$VITSCALE_S3_RETRY_S``, :func:`~vitscale.data.storage.retry.sdk_attempts`): a flaky object store
costs a few retried requests and a dead one ends the upload within the budget with the SDK's last
error. The endpoint comes from ``endpoint_url``, else ``VITSCALE_S3_ENDPOINT_URL``, else
``AWS_ENDPOINT_URL`` (as for datasets); credentials from the AWS SDK's standard chain.

Ray pickles the filesystem into its controller and every worker, and pyarrow's ``S3FileSystem``
pickles without its retry strategy (pyarrow 26: the copy gets the SDK's default of 3 tries), so the
filesystem is a subclass that pickles its constructor arguments and is rebuilt from them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs

from vitscale.config.location import is_url
from vitscale.data.storage.retry import RetryPolicy, call, retry_budget_s, sdk_attempts
from vitscale.data.storage.s3 import resolve_endpoint_url

__all__ = ["RetryingS3FileSystem", "clear_stale", "copy_folder", "ensure_uploaded", "run_filesystem"]


def run_filesystem(storage_path: str, *, endpoint_url: str | None = None,
                   max_attempts: int | None = None, connect_timeout_s: float = 10.0,
                   request_timeout_s: float = 120.0) -> tuple[Any, str]:
    """``(storage_filesystem, storage_path)`` for Ray's ``RunConfig``: ``(None, storage_path)`` for a
    local or NFS folder (Ray's default), a retrying ``pyarrow.fs.S3FileSystem`` and the path without
    its ``s3://`` for object storage (Ray wants the bare path beside a filesystem).

    ``max_attempts``: tries per request; None: as many as end within the retry budget."""
    if not storage_path.startswith("s3://"):
        return None, storage_path
    if max_attempts is None:
        max_attempts = sdk_attempts(retry_budget_s())
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    kwargs: dict[str, Any] = {
        "connect_timeout": connect_timeout_s,
        "background_writes": False,
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
    return RetryingS3FileSystem(max_attempts, **kwargs), storage_path[len("s3://"):].rstrip("/")


class RetryingS3FileSystem(pyarrow.fs.S3FileSystem):
    """A ``pyarrow.fs.S3FileSystem`` retrying each request up to ``max_attempts`` times, wherever it
    is unpickled (``kwargs``: the rest of its constructor's arguments)."""

    def __init__(self, max_attempts: int, **kwargs: Any) -> None:
        super().__init__(retry_strategy=pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=max_attempts), **kwargs)
        self.arguments = (max_attempts, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        max_attempts, kwargs = self.arguments
        return _rebuild, (max_attempts, kwargs)


def _rebuild(max_attempts: int, kwargs: dict[str, Any]) -> RetryingS3FileSystem:
    return RetryingS3FileSystem(max_attempts, **kwargs)


def ensure_uploaded(local: str | os.PathLike[str], storage: str, *, endpoint_url: str | None = None,
                    retry: RetryPolicy | None = None) -> list[str]:
    """Check that every file of the local folder ``local`` is in the folder ``storage`` (a local path
    or ``s3://`` URL) at its size; copy again the ones that are not. Returns the names copied again.

    ``pyarrow.fs.copy_files`` (Ray Train's checkpoint upload) drops the error of a multipart upload
    whose last part or completion failed after its retries (pyarrow 26): the copy "succeeds" and
    the object is missing. Here each missing file is written through an output stream, whose close
    does raise. The filesystem does not retry on its own: every request goes through
    :func:`~vitscale.data.storage.retry.call` with ``retry`` (default: the ``$VITSCALE_S3_RETRY_S``
    budget), so errors that will not heal stop at once and the others within the budget, in one
    :class:`~vitscale.data.storage.StorageError` naming the file's URL, the last error and the tries.
    """
    policy = retry or RetryPolicy.from_setting()
    filesystem, root = _filesystem(storage, endpoint_url)
    scheme = "s3://" if storage.startswith("s3://") else ""
    base = Path(local)
    files = sorted(p for p in base.rglob("*") if p.is_file())
    remote = [f"{root}/{p.relative_to(base).as_posix()}" for p in files]
    infos = call(lambda: filesystem.get_file_info(remote), policy, "list", storage)
    copied = []
    for path, target, info in zip(files, remote, infos, strict=True):
        if info.type == pyarrow.fs.FileType.File and info.size == path.stat().st_size:
            continue
        call(functools.partial(_copy, path, filesystem, target), policy, "store", scheme + target)
        copied.append(path.relative_to(base).as_posix())
    return copied


def copy_folder(local: str, filesystem: Any, destination: str) -> None:
    """Copy the local folder ``local`` to ``destination`` on ``filesystem`` as Ray Train's own checkpoint upload
    does (``create_dir``, then ``pyarrow.fs.copy_files`` in one thread, in 64 MiB chunks: pyarrow's threaded
    upload to S3 is unsafe, apache/arrow#32372), each request tried as the filesystem's retry strategy says."""
    filesystem.create_dir(destination)
    threads = not isinstance(filesystem, pyarrow.fs.S3FileSystem)
    pyarrow.fs.copy_files(local, destination, destination_filesystem=filesystem, use_threads=threads,
                          chunk_size=64 << 20)


def _filesystem(storage: str, endpoint_url: str | None) -> tuple[Any, str]:
    """A filesystem that tries each request once (the caller retries through `call`), and the bare path."""
    filesystem, root = run_filesystem(storage, endpoint_url=endpoint_url, max_attempts=1)
    if filesystem is None:
        filesystem, root = (pyarrow.fs.FileSystem.from_uri(storage) if is_url(storage)
                            else (pyarrow.fs.LocalFileSystem(), os.fspath(storage)))
    return filesystem, root


def clear_stale(local: str | os.PathLike[str], storage: str, *, endpoint_url: str | None = None,
                retry: RetryPolicy | None = None) -> list[str]:
    """Remove from the folder ``storage`` the files the local folder ``local`` is about to be copied over; returns
    their names. Only a save of a step whose earlier save failed part-way finds any.

    A copy replaces what it writes, but a file it loses without a word (``ensure_uploaded``) would leave the
    torn save's file of the same name, and at the same size it passes for this save's. Only ``local``'s own
    names are removed: every rank clears, then writes, its own files of a checkpoint, never another's. One
    listing per call; each request through the retry loop, as ``ensure_uploaded``'s.
    """
    policy = retry or RetryPolicy.from_setting()
    filesystem, root = _filesystem(storage, endpoint_url)
    selector = pyarrow.fs.FileSelector(root, allow_not_found=True, recursive=True)
    stored = call(lambda: filesystem.get_file_info(selector), policy, "list", storage)
    base = Path(local)
    mine = {p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()}
    scheme = "s3://" if storage.startswith("s3://") else ""
    removed = []
    for info in stored:
        name = info.path[len(root):].lstrip("/")
        if info.type == pyarrow.fs.FileType.File and name in mine:
            call(functools.partial(filesystem.delete_file, info.path), policy, "delete", scheme + info.path)
            removed.append(name)
    return sorted(removed)


def _copy(path: Path, filesystem: Any, target: str) -> None:
    """One try at writing the local file ``path`` to ``target``; the stream's close reports a failed upload."""
    with path.open("rb") as source, filesystem.open_output_stream(target) as out:
        shutil.copyfileobj(source, out, 8 << 20)
