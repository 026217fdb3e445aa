"""Files written whole or not at all: the one rule for every file vitscale writes into a run.

A disk can fill at any moment, and a process can die at any moment. Whatever vitscale writes (a
checkpoint's own files and manifests, a run's config and summary, tables and plots, metrics and
logs) must then still hold its previous version, never a torn one that a reader takes for complete:

* a whole file is written to a hidden temporary sibling (``.NAME.<random>.part``: local storage
  listings and run mirrors skip that name) and renamed over the old one only once it is complete and
  on disk (:func:`atomic_path`, :func:`write_atomic`); a failed write removes the temporary file, so a
  full disk is not made fuller by it;
* a file of records (JSONL metrics, sample records, logs) only ever grows by whole records: an append
  that fails part-way is cut back to where it started, and a record torn by a writer that was killed
  is cut off when the file is next opened (:class:`AppendOnly`). Rewriting such a file on every record
  would cost its whole size per step.

An ``OSError`` raised here names the file being written (``filename``, never the temporary name),
so the one line a full disk ends in says which file did not fit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from vitscale.data.storage.cleanup import after_error, remove_file

__all__ = ["PART_SUFFIX", "AppendOnly", "atomic_path", "create_part_file", "write_atomic"]

PART_SUFFIX = ".part"
"""Ends the name of a file being written (hidden: it starts with a dot); readers skip such names."""


def create_part_file(path: Path) -> tuple[int, Path]:
    """Create a hidden sibling ``.NAME.<random>.part`` of ``path`` (open for writing) and its folder.

    Unlike ``mkstemp`` (always 0600) this honours the umask, so finished files get the usual
    permissions of the folder's other files.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{os.urandom(6).hex()}{PART_SUFFIX}"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary file next to {path}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Within: a temporary path to write ``path``'s new content to (for writers that want a path:
    ``torch.save``, parquet, ``savefig``); on leaving, it replaces ``path`` once synced to disk.

    If the body or the sync fails, the temporary file is removed and ``path`` keeps its previous
    version (or stays absent).
    """
    target = Path(path)
    try:
        fd, tmp = create_part_file(target)
    except OSError as exc:
        raise _naming(exc, target) from None
    os.close(fd)
    try:
        yield tmp
        _sync(tmp)  # a delayed allocation's ENOSPC (and NFS's) only shows here: before the rename, not after
        os.replace(tmp, target)
    except BaseException as exc:
        # A cleanup never hides the cause (cleanup.py): a failed removal becomes a note on `exc`.
        after_error(exc, f"removing {tmp}", lambda: remove_file(tmp))
        if isinstance(exc, OSError):
            _naming(exc, target)
        raise


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` whole, or leave its previous version (module doc)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(path) as tmp:
        tmp.write_bytes(payload)


class AppendOnly:
    """A file of newline-ended records that only ever grows by whole records (module doc).

    One instance per file and process: appends from several threads go through its lock-free
    ``O_APPEND`` descriptor one record per call.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        except OSError as exc:
            raise _naming(exc, self.path) from None
        self._cut_torn_tail()

    def append(self, record: str) -> None:
        """Append ``record`` (a newline is added if it has none), whole, or raise and leave the file as it was."""
        if self._fd is None:
            raise ValueError(f"{self.path}: append after close")
        data = record.encode("utf-8") if record.endswith("\n") else (record + "\n").encode("utf-8")
        end = os.fstat(self._fd).st_size
        try:
            written = 0
            while written < len(data):  # a nearly full disk takes part of a write, then refuses the rest
                written += os.write(self._fd, data[written:])
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)  # frees what the torn record took: this cannot need space
            raise _naming(exc, self.path) from None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _cut_torn_tail(self) -> None:
        """Cut a last record without its newline (its writer died mid-write): it is not a record."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        with open(self.path, "rb") as f:
            start = max(0, size - (1 << 16))
            f.seek(start)
            tail = f.read()
        if tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n")
        if cut < 0 and start > 0:  # a torn record longer than 64 KiB: no record is that long; leave it be
            return
        os.ftruncate(self._fd, start + cut + 1)


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path``, the file being written, rather than its temporary name or nothing."""
    exc.filename = str(path)
    return exc
