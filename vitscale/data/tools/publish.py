"""Where a write lands: the destination is claimed, filled, then published; never a half-dataset.

A dataset is visible to readers only through its ``dataset.json`` (:func:`vitscale.data.format.has_dataset`,
``open_dataset``). The writer therefore:

1. claims the destination (:func:`claim`): refuses one that holds a dataset, or shards/an index
   that no vitscale write left; clears what an interrupted earlier write left (named by the
   :data:`WRITING` marker it leaves there), so a re-run to the same destination works;
2. writes the shards and ``_index.parquet``, each under a staging name first (a hidden ``.part``
   file renamed into place on a local disk; on S3 a PUT, which no reader sees until it completes);
3. writes ``dataset.json`` last, the same way, and removes the marker (:func:`release`).

An error or interruption before step 3 leaves no ``dataset.json``: the folder is never read as a
dataset. :func:`abort` removes what the failed write put there, best effort: an error while
cleaning up is added to the original error as a note, never raised in its place
(:mod:`vitscale.data.storage.cleanup`), and the marker stays so the next write clears the rest.
A local destination folder the write created (and any parent it created with it) is removed again
when it is left empty; a folder that was there before stays, as it was.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from vitscale.config.errors import UserError
from vitscale.data.format import INDEX_NAME, META_NAME
from vitscale.data.storage import LocalStorage, Storage, StorageError
from vitscale.data.storage.atomic import PART_SUFFIX
from vitscale.data.storage.cleanup import after_error, missing_folders, remove_file, remove_new_folders
from vitscale.data.storage.lease import RunLease, hold_run_lease
from vitscale.data.storage.space import NO_FILES, free_bytes, is_no_space, out_of_files, size_text

__all__ = ["WRITING", "abort", "claim", "held", "no_space", "release"]

log = logging.getLogger(__name__)

WRITING = ".vitscale-writing"
"""Marker object: a vitscale write into this destination began and has not finished."""

_SHARD = re.compile(r"[A-Za-z0-9_]+-\d{6}\.tar")


def _ours(names: list[str]) -> list[str]:
    return [n for n in names if n == INDEX_NAME or _SHARD.fullmatch(n)]


_LEASES: dict[str, RunLease] = {}
"""The lease each destination being written is held by (one writer per destination)."""
_CREATED: dict[str, list[Path]] = {}
"""The local folders each destination's write created (deepest first): what a failed write removes."""


def claim(storage: Storage) -> None:
    """Make ``storage`` ready for a new dataset and mark it as being written (see the module doc).

    The destination's lease (:mod:`vitscale.data.storage.lease`) is taken first and held until
    :func:`release` or :func:`abort`: a second write to the same place is refused in one line naming
    the first, so the leftovers cleared below are always a dead write's, never a live one's.
    """
    # Before the lease: taking it creates a local destination folder.
    created = missing_folders(storage.url) if isinstance(storage, LocalStorage) else []
    if isinstance(storage, LocalStorage):
        _check_outside_datasets(storage.root)
    else:
        _check_outside_remote_datasets(storage)
    lease = hold_run_lease(storage.url, endpoint_url=getattr(storage, "endpoint_url", None), kind="dataset")
    _LEASES[storage.url], _CREATED[storage.url] = lease, created
    try:
        _claim(storage)
    except BaseException as exc:
        after_error(exc, f"releasing the lease on {storage.url}", lambda: _drop_lease(storage))
        raise


@contextmanager
def held(storage: Storage) -> Iterator[None]:
    """``storage``'s lease held around a write that claims nothing (``shards index`` writes only an index and
    ``dataset.json`` beside tars that are there). Two indexes of one place at once both found no ``dataset.json``
    and the last to finish replaced the other's, each told it had succeeded; now the second is refused in one
    line, by the lease while the first writes, or by the first's ``dataset.json`` once it has finished."""
    with hold_run_lease(storage.url, endpoint_url=getattr(storage, "endpoint_url", None), kind="dataset"):
        if storage.exists(META_NAME):
            raise UserError(f"{storage.url_of(META_NAME)} exists: {storage.url} became a dataset meanwhile (another "
                            f"index or write into it finished first); index into another --out")
        yield


def _check_outside_datasets(root: Path) -> None:
    """Refuse a destination inside another dataset's folder (`dedup --out TRAIN/clean`): a dataset's files
    are the ones below its folder, so that dataset would then fail `shards verify` (shards it does not list)."""
    for parent in root.parents:
        if (parent / META_NAME).is_file():
            raise UserError(f"{root} is inside the dataset {parent}, whose files are all those below it (`shards "
                            f"verify {parent}` would fail on the shards written here); write to a folder outside it")


def _check_outside_remote_datasets(storage: Storage) -> None:
    """`_check_outside_datasets` in object storage: a HEAD of `dataset.json` in each prefix above the destination
    (a few requests; was not checked there at all, and `dedup --out s3://b/train/clean` broke `train`)."""
    from vitscale.data.storage import open_storage

    parent = storage.url.rpartition("/")[0]
    while not parent.endswith(":/"):  # up to, and including, the bucket's root
        if open_storage(parent, endpoint_url=getattr(storage, "endpoint_url", None)).exists(META_NAME):
            raise UserError(f"{storage.url} is inside the dataset {parent}, whose files are all those below it "
                            f"(`shards verify {parent}` would fail on the shards written here); write outside it")
        parent = parent.rpartition("/")[0]


def _drop_lease(storage: Storage) -> None:
    lease = _LEASES.pop(storage.url, None)
    created = _CREATED.pop(storage.url, [])
    if lease is not None:
        lease.release()
    remove_new_folders(created)  # only those left empty: after a publish, or a cleanup that failed, none


def _claim(storage: Storage) -> None:
    names = storage.list()
    if META_NAME in names:
        raise UserError(f"{storage.url} already holds a dataset ({META_NAME}); write to a new --out or delete it first")
    leftovers = _ours(names)
    if leftovers and WRITING not in names:
        raise UserError(f"{storage.url} holds {leftovers[0]} but no {META_NAME}, and no vitscale write left it "
                         "there; write to a new --out or delete those files first")
    for name in leftovers:  # an interrupted earlier write's shards and index
        storage.delete(name)
    if isinstance(storage, LocalStorage):  # and the files it was copying in when killed (hidden: never listed)
        for part in storage.root.glob(f".*{PART_SUFFIX}"):
            if _ours([part.name[1:-len(PART_SUFFIX)].rpartition(".")[0]]):  # `.NAME.<random>.part`: atomic.py
                remove_file(part)
    storage.write_bytes(WRITING, json.dumps({"pid": os.getpid(), "started": time.time()}).encode())


def release(storage: Storage) -> None:
    """The write finished (``dataset.json`` is in place): remove the marker, give the lease back."""
    try:
        storage.delete(WRITING)
    except OSError as exc:  # the dataset is complete; a stale marker only costs the next claim a look
        log.warning("could not remove %s: %s", storage.url_of(WRITING), exc)
    finally:
        _drop_lease(storage)


def abort(storage: Storage, error: BaseException, *, also: Sequence[str] = ()) -> None:
    """Remove the shards and index a failed write left (and the names in ``also``: a tool's own files),
    and a folder the write created; never raise over ``error``, except to say in one line that the
    destination's disk is full (:func:`no_space`)."""
    written, free, no_files = None, free_bytes(storage.url), out_of_files(storage.url)  # before the cleanup frees any

    def remove() -> None:
        nonlocal written
        sizes = storage.list_sizes()
        written = sum(sizes[name] for name in _ours(list(sizes)))
        for name in [*_ours(list(sizes)), *(n for n in also if n in sizes)]:
            storage.delete(name)
        storage.delete(WRITING)

    after_error(error, f"cleaning up {storage.url} (the next write to it clears what is left)", remove)
    after_error(error, f"releasing the lease on {storage.url}", lambda: _drop_lease(storage))
    if isinstance(error, Exception) and is_no_space(error) and not isinstance(error, StorageError):
        raise no_space(storage, written, free, no_files=no_files) from error


def no_space(storage: Storage, written: int | None, free: int | None, *, no_files: bool = False) -> StorageError:
    """One line for a destination whose disk filled: its path, what fitted and the space needed.

    What was written plus what was still free when the write failed did not hold the dataset, so it
    needs more than their sum. ``no_files``: it was the filesystem's inodes that ran out, not its bytes.
    """
    if no_files:
        return StorageError(f"no space left on the device of {storage.url}: {NO_FILES} ({size_text(free)} free); "
                            "remove files there (what was written is removed) or choose another --out, and write again")
    need = (f"it needs more than {size_text(written + free)} there ({size_text(written)} written before the disk "
            f"filled, {size_text(free)} free)") if written is not None and free is not None else \
        f"{size_text(free)} free there"
    return StorageError(f"no space left on the device of {storage.url}: {need}; free space (what was written is "
                        "removed) or choose another --out, and write again")
