"""Cleaning up after a failure without hiding it: the one rule for every cleanup in ``data/``.

A write that fails removes what it made (a spool file, shards, a lease, a folder it created). That
cleanup can fail too (the store that broke the write refuses the delete, a file is already gone),
and an error raised from an ``except`` or ``finally`` block replaces the one being handled: the
user would read about a missing temporary file instead of the upload that failed. So a cleanup
after an error goes through :func:`after_error`: its own failure becomes a note on the original
error, which is the one raised.

A process killed outright (SIGKILL, the OOM killer) runs no cleanup at all: the spool files it wrote
through stay in the temporary folder, a shard's worth each. :func:`spool_file` hands out spools locked
(``flock``) while their writer lives, and removes the unlocked ones a killed writer left.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["after_error", "missing_folders", "remove_file", "remove_new_folders", "remove_unlocked", "scratch_folder",
           "spool_file", "spool_folder"]


def after_error(error: BaseException, what: str, step: Callable[[], object]) -> None:
    """Run the cleanup ``step`` (``what`` says what it does) of an operation that failed with ``error``;
    a failure of the cleanup is added to ``error`` as a note, never raised in its place."""
    try:
        step()
    except Exception as cleanup:  # noqa: BLE001 -- the original error is the one to report
        error.add_note(f"while {what}: {type(cleanup).__name__}: {cleanup}")


def remove_file(path: str | os.PathLike[str]) -> None:
    """Remove the local file ``path`` if it is there (removing it twice is no error)."""
    Path(path).unlink(missing_ok=True)


def missing_folders(path: str | os.PathLike[str]) -> list[Path]:
    """The folders of ``path`` (itself included) that do not exist yet, deepest first: what a write into
    ``path`` creates and what its cleanup may remove again."""
    missing: list[Path] = []
    current = Path(path).expanduser().absolute()
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    return missing


def remove_new_folders(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first, as :func:`missing_folders` lists them) while they are empty;
    a folder someone else put files in meanwhile stays, and so do the folders above it."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty (or not ours to remove): leave it and what holds it
            return


_SWEPT: set[tuple[str, str]] = set()
"""The spool names this process has cleared the dead writers' spools of (once each)."""


def spool_file(prefix: str, suffix: str) -> BinaryIO:
    """A new temporary file ``PREFIX<random>SUFFIX``, open for writing; its ``name`` is its path. Its writer
    closes it only once it has removed it: until then it holds the file's lock, which the kernel drops when
    the process dies however it dies. The first spool of a name in a process removes the unlocked ones of
    that name, a killed writer's; the lock, not a pid, tells (pids do not cross containers sharing a /tmp).
    """
    folder = _sweep(prefix, suffix)
    fd, opening = tempfile.mkstemp(prefix=prefix, suffix=".opening", dir=folder)
    spool = os.fdopen(fd, "wb")
    spool.raw.name = _locked(fd, opening, suffix)  # type: ignore[attr-defined]  # its path, not its number
    return spool


def spool_folder(prefix: str) -> tuple[Path, int]:
    """A new temporary folder ``PREFIX<random>`` and the descriptor that holds its lock: close it once the
    folder is removed, or renamed out of the prefix to be kept. Killed writers' folders go as in
    :func:`spool_file`."""
    folder = _sweep(prefix, "")
    opening = tempfile.mkdtemp(prefix=prefix, suffix=".opening", dir=folder)
    fd = os.open(opening, os.O_RDONLY)
    return Path(_locked(fd, opening, "")), fd


@contextlib.contextmanager
def scratch_folder(prefix: str) -> Iterator[Path]:
    """A new temporary folder ``PREFIX<random>`` for the block's work, removed when it ends however it ends; a
    process killed inside it (SIGKILL, the OOM killer: a training rank mid-checkpoint) leaves it unlocked, and
    the next :func:`spool_folder` of the same prefix on this machine removes it (a checkpoint's size each)."""
    folder, lock = spool_folder(prefix)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock)


def _sweep(prefix: str, suffix: str) -> str:
    """The temporary folder, once this process has removed the unlocked ``PREFIX*SUFFIX`` spools there."""
    folder = tempfile.gettempdir()
    if (folder, prefix + suffix) not in _SWEPT:
        _SWEPT.add((folder, prefix + suffix))
        for path in Path(folder).glob(f"{prefix}*{suffix}"):
            with contextlib.suppress(OSError):  # held by a live writer, or gone meanwhile: left alone
                remove_unlocked(path)
    return folder


def _locked(fd: int, opening: str, suffix: str) -> str:
    fcntl.flock(fd, fcntl.LOCK_EX)
    final = opening.removesuffix(".opening") + suffix
    os.rename(opening, final)  # under its final name only once locked: a sweep never takes a live one
    return final


def remove_unlocked(path: Path) -> None:
    """Remove the spool ``path`` unless a live writer holds its lock (then ``BlockingIOError``)."""
    if path.name.endswith(".opening"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError (an OSError) while its writer lives
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    finally:
        os.close(fd)
