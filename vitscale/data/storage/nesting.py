"""Writers inside or around one another: whose live lease lies in the folders above a run, or below it.

A run's rotation, mirror and resume take every file under its folder for its own, so no writer may work
inside another live writer's folder, nor around one (`lease.py` refuses both, naming the other). This
finds them: a local lease is live while its lock is held (probed with a shared lock for an instant, which
never creates the file); an S3 lease while it was renewed within its ttl by a holder that did not die on
this machine. Pure reads: nothing here writes.
"""

from __future__ import annotations

import email.utils
import os
import posixpath
import time
from pathlib import Path

from vitscale.data.storage.holder import DEFAULT_TTL_S, Holder
from vitscale.data.storage.retry import RetryPolicy
from vitscale.data.storage.s3 import S3Storage

__all__ = ["ancestors", "live_above", "live_below", "live_local", "live_s3", "read_lease_object", "who"]


def live_local(folder: Path, name: str) -> str | None:
    """Who holds the lease ``name`` of ``folder`` while alive (a description), or None when no live writer does.

    A lease file whose lock nobody holds is a finished or crashed writer's (the kernel drops the lock with
    its process); probing takes a shared lock for an instant, never creates the file.
    """
    import fcntl

    try:
        fd = os.open(folder / name, os.O_RDONLY)
    except OSError:  # no lease there (or one this user may not read: then no writer of this user's)
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return who(Holder.decode(os.pread(fd, 4096, 0)))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def who(holder: Holder | None) -> str:
    """A lease holder as messages name it."""
    return holder.describe() if holder is not None else "an unknown writer"


def read_lease_object(storage: S3Storage, name: str) -> tuple[Holder | None, str, float] | None:
    """The lease object ``name`` of ``storage``: (holder, etag, seconds since it was last renewed, by the
    server's clock), or None if there is none."""
    try:
        resp = storage._retrying("lease", name, lambda: storage.client.get_object(
            Bucket=storage.bucket, Key=storage.key_of(name)))
    except FileNotFoundError:
        return None
    body = resp["Body"].read(1 << 16)
    resp["Body"].close()
    date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
    return Holder.decode(body), str(resp["ETag"]), max(0.0, now - resp["LastModified"].timestamp())


def live_s3(storage: S3Storage, name: str) -> str | None:
    """Who holds the lease object ``name`` while alive (a description), or None when no live writer does:
    live as `_S3Lease` takes it, renewed within its ttl and not a holder that died on this machine."""
    current = read_lease_object(storage, name)
    if current is None:
        return None
    holder, _, age = current
    ttl = holder.ttl_s if holder is not None else DEFAULT_TTL_S
    return who(holder) if age <= ttl and not (holder is not None and holder.dead_here()) else None


def ancestors(url: str, part_of: str | None) -> list[str]:
    """The folders (or prefixes) above the canonical ``url``, nearest first, up to the filesystem root or
    the bucket; with ``part_of`` (the run this writer is a part of, which holds its own lease and looked
    above itself when it took it), only those below ``part_of``."""
    if url.startswith("s3://"):
        bucket, *parts = url[len("s3://"):].split("/")
        above = ["/".join([f"s3://{bucket}", *parts[:i]]) for i in range(len(parts) - 1, -1, -1)]
    else:
        above = [str(p) for p in Path(url).parents]
    if part_of is not None:
        outer = [i for i, a in enumerate(above) if part_of == a or part_of.startswith(a.rstrip("/") + "/")]
        above = above[:outer[0]] if outer else above
    return above


def live_above(url: str, name: str, *, part_of: str | None = None, endpoint_url: str | None = None,
               retry: RetryPolicy | None = None) -> tuple[str, str] | None:
    """(folder, who) of the nearest folder above the canonical ``url`` whose lease ``name`` is live (`ancestors`
    says which are looked at), or None."""
    above = ancestors(url, part_of)
    if url.startswith("s3://") and above:
        bucket = url[len("s3://"):].partition("/")[0]
        root = S3Storage(bucket, endpoint_url=endpoint_url, retry=retry)
        for outer in above:
            holder = live_s3(root, posixpath.join(outer[len(f"s3://{bucket}"):].strip("/"), name))
            if holder is not None:
                return outer, holder
        return None
    for outer in above:
        holder = live_local(Path(outer), name)
        if holder is not None:
            return outer, holder
    return None


def live_below(url: str, name: str, storage: S3Storage | None = None) -> tuple[str, str] | None:
    """(folder, who) of a folder below ``url`` (its ``storage`` when on S3) whose lease ``name`` is live, or None."""
    if storage is not None:
        for key in storage.list():
            if key.endswith("/" + name):
                holder = live_s3(storage, key)
                if holder is not None:
                    return storage.url_of(key)[: -len(name) - 1], holder
        return None
    folder = Path(url)
    for root, _, files in os.walk(folder):
        if name in files and Path(root) != folder:
            holder = live_local(Path(root), name)
            if holder is not None:
                return root, holder
    return None
