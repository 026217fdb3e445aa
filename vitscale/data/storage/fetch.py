"""Local copies of things in object storage: a weights file, a checkpoint folder, a run's files.

Tools that read a model (`vitscale export | fewshot | inspect | finetune`, `finetune.checkpoint`)
work on local files. Given an `s3://` location they read a copy from the cache instead
(`$VITSCALE_CACHE`, default `~/.cache/vitscale`), laid out as `storage/s3/<bucket>/<key>` for AWS and
`storage/s3@<hash of the endpoint>/<bucket>/<key>` for another endpoint (one bucket name on MinIO and on
AWS are two places, and a copy of one must never be read as the other). An object
already in the cache is not fetched again (a folder's files judged by size, one file by its version:
S3's ETag, for a file written again at its size); a download lands under a temporary name and is
renamed, so an interrupted fetch never leaves a file that looks whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
from pathlib import Path

from vitscale.config.location import canonical_endpoint, canonical_location, is_url
from vitscale.data.storage import open_storage, resolve_endpoint_url
from vitscale.data.storage.atomic import write_atomic
from vitscale.data.storage.base import Storage
from vitscale.data.storage.cleanup import after_error, remove_file, remove_unlocked

__all__ = ["cache_root", "is_folder", "local_copy", "named_as_stored", "subfolders"]


def cache_root() -> Path:
    """Where copies of remote objects are kept: `$VITSCALE_CACHE`, else `~/.cache/vitscale`."""
    return Path(os.environ.get("VITSCALE_CACHE") or Path.home() / ".cache" / "vitscale").expanduser()


def _split(url: str) -> tuple[Storage, str]:
    """(storage of the url's parent, the url's last name)."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/"):
        raise ValueError(f"{url}: name a file or folder inside a bucket, not the bucket itself")
    return open_storage(parent), name


def _cached_path(url: str) -> Path:
    scheme, _, rest = url.partition("://")
    endpoint = canonical_endpoint(resolve_endpoint_url())  # the endpoint open_storage reads `url` from
    if endpoint:
        scheme = f"{scheme}@{hashlib.sha256(endpoint.encode()).hexdigest()[:12]}"
    return cache_root() / "storage" / scheme / rest.rstrip("/")


def named_as_stored(location: str | Path, text: str) -> str:
    """`text` (an error about the local copy of `location`) with the copy's paths written as the URLs they are
    copies of: the cache is not where the user's file is, nor where they can mend it."""
    location = str(location)
    if not is_url(location):
        return text
    url = canonical_location(location, "location")
    return text.replace(str(_cached_path(url)), url)


def local_copy(location: str | Path) -> Path:
    """A local path holding what `location` holds: the path itself when it is local; for a URL, a copy
    in the cache of the object (a file) or of everything under the prefix (a folder).

    FileNotFoundError when the URL names nothing; a misspelt one (`s3:/bar/w.npz`) is refused
    (`canonical_location`), never read as a local path.
    """
    location = canonical_location(str(location), "location")
    if not is_url(location):
        return Path(location)
    storage, name = _split(location)
    target = _cached_path(location)
    if storage.exists(name):  # one object: a weights file
        _fetch(storage, name, target)
        return target
    names = storage.list_sizes(name + "/")
    if not names:
        raise FileNotFoundError(f"{location}: no such file or folder in storage")
    for key, size in names.items():
        if not key.endswith("/"):  # folder markers are not files
            _fetch(storage, key, target / key[len(name) + 1:], size)
    return target


def is_folder(location: str | Path) -> bool:
    """Whether `location` (a path or URL) is a folder (a run, a checkpoint) rather than one file."""
    location = canonical_location(str(location), "location")
    if not is_url(location):
        return local_copy(location).is_dir()
    storage, name = _split(location)
    return not storage.exists(name) and bool(storage.list_sizes(name + "/"))


def subfolders(location: str) -> list[str]:
    """The URLs of the folders directly under `location` (a prefix in object storage), sorted."""
    storage = open_storage(location.rstrip("/"))
    tops = {key.split("/", 1)[0] for key in storage.list() if "/" in key}
    return [f"{location.rstrip('/')}/{top}" for top in sorted(tops)]


def _fetch(storage: Storage, name: str, target: Path, size: int | None = None) -> None:
    """Copy ``name`` to ``target`` unless it is there already. A folder's files (``size`` from its listing: a
    checkpoint's, never rewritten under their names) are judged by size; one file by its version, kept beside
    it (``.NAME.version``): an export written again to its URL has the same size, not the same weights."""
    stamp = target.with_name(f".{target.name}.version")
    version = storage.version(name) if size is None else None
    if target.is_file() and (target.stat().st_size == size if version is None else
                             stamp.is_file() and stamp.read_text() == version):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_file(stamp)  # before the copy changes: a stamp never vouches for another copy
    for stale in target.parent.glob(f".{glob.escape(target.name)}.*.part"):  # a killed fetch's, a file's size
        with contextlib.suppress(OSError):  # locked: another process is fetching it now
            remove_unlocked(stale)
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:  # streamed: a checkpoint's optimizer states can be larger than memory
        with storage.open_read(name) as source, part.open("wb") as out:
            fcntl.flock(out.fileno(), fcntl.LOCK_EX)  # while this process lives (cleanup.spool_file)
            shutil.copyfileobj(source, out, 8 << 20)
            out.flush()
            part.replace(target)  # still locked: a sweep never takes a part being renamed
    except BaseException as exc:
        after_error(exc, f"removing {part}", lambda: remove_file(part))
        raise
    if version is not None:
        write_atomic(stamp, version)
