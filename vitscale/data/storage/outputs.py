"""Where a command's output lands: a local file or folder, or one in object storage, checked before the work.

`vitscale export --out` writes one file and `vitscale inspect --out` a folder; on a cluster whose only
shared disk is a bucket, that place is an `s3://` URL as often as a path. Each is written locally first
(the libraries that write them take paths) and, for a URL, uploaded when the writing ends without an
error; the local copy is then removed. A location is checked before any work starts (`check_output`:
theirs, `shards write | index | dedup --out`'s, and a run's `cluster.storage_path`), so minutes of work
never end in an error about the place they were meant for:

- a file's place must not be an existing folder, and a folder's not an existing file;
- no folder on a local path may be a file, and the first folder that exists must be writable;
- a URL must be spelt right (`canonical_location`) and name something inside a bucket, and its bucket
  must answer (a missing bucket or refused credentials are one line here, not after the work).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

from vitscale.config.checks import ConfigError
from vitscale.config.location import canonical_location, is_url
from vitscale.data.storage.atomic import atomic_path
from vitscale.data.storage.cleanup import after_error, missing_folders, remove_file, remove_new_folders, spool_folder

__all__ = ["check_output", "output_file", "output_folder"]


def check_output(location: str, flag: str, *, folder: bool, endpoint_url: str | None = None) -> str:
    """`location` in its one spelling, once it can take a file (`folder=False`) or a folder of files;
    a `ConfigError` naming `flag` (a command's argument, or the pipeline key it came from) otherwise."""
    location = canonical_location(str(location), flag)  # a local path made absolute, or an s3:// URL
    if is_url(location):
        _check_remote(location, flag, folder, endpoint_url)
        return location
    path = Path(location)
    if path.is_dir() and not folder:
        raise ConfigError(flag, f"{location} is a folder; name the file to write inside it")
    if path.exists() and not path.is_dir() and folder:
        raise ConfigError(flag, f"{location} is a file; name a folder to write the files into")
    existing = path if path.exists() else next((p for p in path.absolute().parents if p.exists()), Path("/"))
    if existing != path and not existing.is_dir():
        raise ConfigError(flag, f"{location}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):  # a folder: new entries; a file: itself
        # A read-only mount refuses root too: "by this user" would send them to chmod, which cannot help.
        why = "is on a read-only file system" if _read_only(existing) else "is not writable by this user"
        raise ConfigError(flag, f"{location}: {existing} {why}")
    return location


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs here: not ours to tell
        return False


def _check_remote(location: str, flag: str, folder: bool, endpoint_url: str | None) -> None:
    from vitscale.data.storage import open_storage

    parent, _, name = location.rpartition("/")
    at_root = parent.endswith(":/")  # the bucket itself
    if at_root and not folder:  # a file needs a name
        raise ConfigError(flag, f"{location}: name the file to write inside the bucket, not the bucket itself")
    # A listing of a name no object bears, under the place itself: a bucket that does not exist, or credentials
    # it refuses, fail here (a HEAD of a missing object answers 404 whether or not its bucket exists), and it
    # costs one request however many objects the place already holds (a storage path's every run).
    place = open_storage(location, endpoint_url=endpoint_url, key=flag)
    place.list_sizes(PROBE)
    # As on a disk, a file is not written over a folder nor files into a file: S3 would take both, and the object
    # would then shadow the folder for every reader that asks for one name (`fetch.local_copy` reads the file).
    if not folder and place.holds_any(""):
        raise ConfigError(flag, f"{location} is a folder (objects are stored under it); name the file to write "
                          "inside it")
    if folder and not at_root and open_storage(parent, endpoint_url=endpoint_url, key=flag).exists(name):
        raise ConfigError(flag, f"{location} is a file; name a folder to write the files into")


PROBE = ".vitscale-probe"
"""The name listed to learn whether a bucket answers: no object bears it, so the answer is one empty page."""


@contextlib.contextmanager
def output_file(location: str, flag: str, *, endpoint_url: str | None = None) -> Iterator[Path]:
    """A local path to write one file at; it ends at `location` (as `check_output` returned it, before the
    work) when the block ends without an error, whole or not at all: renamed over a local path (its folders
    made; `atomic.py`), or uploaded to a URL. The path's name is not the destination's (a hidden part file
    beside it), so the writer is told its format, never left to guess it from the name."""
    if not is_url(location):
        with atomic_path(location) as path:
            yield path
        return
    from vitscale.data.storage import open_storage

    parent, _, name = location.rpartition("/")

    def upload(spool: Path) -> None:
        open_storage(parent, endpoint_url=endpoint_url, key=flag).write_file(name, spool / name)

    with _spooled(location, upload) as spool:
        yield spool / name


@contextlib.contextmanager
def output_folder(location: str, flag: str, *, endpoint_url: str | None = None, marker: str | None = None,
                  replaces: Sequence[str] = ()) -> Iterator[Path]:
    """A local folder to write files into; they end under `location` (as `check_output` returned it, before
    the work) when the block ends without an error: the folder itself (made), or a URL prefix they are
    uploaded under.

    `marker` names the file whose presence says the folder holds one whole set (`inspect.json`); the caller
    writes it last. It and the names in `replaces` (every file such a set may hold) are removed from
    `location` first, and uploaded last, so a write interrupted, failed or producing fewer files than the
    one before never leaves an earlier marker beside new files, a marker beside files yet to come, or the
    earlier set's files beside a marker that does not name them. A local write that fails or is interrupted
    removes those names again (its half set) and the folders it made while they are empty, as a failed
    `shards write` does (`data/tools/publish.py`)."""
    stale = [name for name in (marker, *replaces) if name is not None]
    if not is_url(location):
        path = Path(location)
        created = missing_folders(path)
        path.mkdir(parents=True, exist_ok=True)
        for name in stale:
            remove_file(path / name)
        try:
            yield path
        except BaseException as exc:
            for name in stale:
                after_error(exc, f"removing {path / name}", partial(remove_file, path / name))
            remove_new_folders(created)
            raise
        return
    from vitscale.data.storage import open_storage

    def upload(spool: Path) -> None:
        storage = open_storage(location, endpoint_url=endpoint_url, key=flag)
        files = sorted(p for p in spool.rglob("*") if p.is_file())
        for path in sorted(files, key=lambda p: p.relative_to(spool).as_posix() == marker):  # the marker last
            storage.write_file(path.relative_to(spool).as_posix(), path)

    with _spooled(location, upload) as spool:
        storage = open_storage(location, endpoint_url=endpoint_url, key=flag)
        for name in stale:  # deleting a key that is not there is no error on S3
            storage.delete(name)
        yield spool


@contextlib.contextmanager
def _spooled(location: str, upload: Callable[[Path], None]) -> Iterator[Path]:
    """A local folder for what goes to `location`, `upload`ed once the work in it ends, then removed. The work
    failing removes it; the upload failing (after the storage's retries) keeps it and says where, in the one
    line the error is: the work is not lost."""
    from vitscale.data.storage.base import StorageError

    spool, lock = spool_folder("vitscale-out-")  # locked while this process lives: a killed one's is swept
    try:
        yield spool
    except BaseException:
        shutil.rmtree(spool, ignore_errors=True)
        os.close(lock)
        raise
    try:
        upload(spool)
    except StorageError as exc:
        kept = spool.with_name(spool.name.replace("vitscale-out-", "vitscale-kept-", 1))  # out of the sweep's way
        with contextlib.suppress(OSError):
            spool = spool.rename(kept)
        os.close(lock)
        raise StorageError(f"{exc}; what was written is kept at {spool}: copy it to {location} once the storage "
                           f"answers") from exc
    shutil.rmtree(spool, ignore_errors=True)
    os.close(lock)
