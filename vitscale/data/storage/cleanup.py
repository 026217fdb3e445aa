"""Cleaning up after a failure without hiding it: the one rule for every cleanup in ``data/``.

A write that fails removes what it made (a spool file, shards, a lease, a folder it created). That
cleanup can fail too (the store that broke the write refuses the delete, a file is already gone),
and an error raised from an ``except`` or ``finally`` block replaces the one being handled: the
user would read about a missing temporary file instead of the upload that failed. So a cleanup
after an error goes through :func:`after_error`: its own failure becomes a note on the original
error, which is the one raised.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["after_error", "missing_folders", "remove_file", "remove_new_folders"]


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
