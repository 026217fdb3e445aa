"""The storage interface both back ends implement, and the error a failed operation raises.

Names are relative to the dataset root (``"train-000000.tar"``, ``"_index.parquet"``).
"""

from __future__ import annotations

import io
import os
from typing import BinaryIO

__all__ = ["ObjectReader", "Storage", "StorageError", "check_name", "is_name"]


class StorageError(OSError):
    """A storage operation failed for good (after retries, or with a non-transient error)."""

    final: bool = False
    """Trying again at once repeats it: the error will not heal by waiting (a refusal such as 403), or the
    retry budget was already spent waiting for it to heal (``data/storage/retry.py``). A run whose worker
    meets a final error stops instead of being restarted (``launch/failures.py``)."""

    def __init__(self, *args: object, final: bool = False) -> None:
        super().__init__(*args)
        self.final = final


class ObjectReader(io.RawIOBase):
    """A read-only raw stream over one object of known size: the position bookkeeping every reader
    shares. A subclass reads at ``_pos`` (``readinto``) and may drop state when the position moves
    (``_moved``)."""

    def __init__(self, size: int) -> None:
        self._size, self._pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        new = base + offset
        if new < 0:
            raise ValueError(f"negative seek position {new}")
        if new != self._pos:
            self._moved()
            self._pos = new
        return self._pos

    def _moved(self) -> None:
        """The position is about to change: forget anything tied to the old one."""


class Storage:
    """Interface shared by the local and S3 back ends; names are relative to the dataset root."""

    url: str

    def read_bytes(self, name: str) -> bytes:
        """The whole object ``name``."""
        raise NotImplementedError

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from byte ``start`` (fewer only at end of object)."""
        raise NotImplementedError

    def open_read(self, name: str) -> BinaryIO:
        """A buffered, seekable binary stream over ``name``; close it when done."""
        raise NotImplementedError

    def size(self, name: str) -> int:
        """Object size in bytes."""
        raise NotImplementedError

    def version(self, name: str) -> str:
        """What changes when the object ``name`` is written again: here its size; a store that can tell more
        (S3's ETag) says it, so a copy of it (`fetch.py`) is never kept for a rewrite of the same size."""
        return str(self.size(name))

    def write_bytes(self, name: str, data: bytes) -> None:
        """Create or replace ``name`` with ``data`` (atomically for readers)."""
        raise NotImplementedError

    def write_file(self, name: str, local_path: str | os.PathLike[str]) -> None:
        """Upload or copy the local file ``local_path`` to ``name`` (multipart on S3 when large)."""
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        """Whether object ``name`` exists."""
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[str]:
        """Sorted names (relative to the root) starting with ``prefix``."""
        raise NotImplementedError

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """``{name: size in bytes}`` of the files whose names start with ``prefix``, sorted by name
        (one listing, no request per object). Only names :func:`is_name` accepts: never the root, never
        a folder (nor an object store's folder marker)."""
        raise NotImplementedError

    def holds_any(self, prefix: str) -> bool:
        """Whether any object's name starts with ``prefix`` (one request on an object store, however many)."""
        return bool(self.list_sizes(prefix))

    def delete(self, name: str) -> None:
        """Remove object ``name`` (FileNotFoundError if there is none)."""
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst``, replacing it (atomic on a local disk; copy + delete on S3)."""
        raise NotImplementedError

    def url_of(self, name: str) -> str:
        """A full address of ``name`` for messages and other tools."""
        raise NotImplementedError

    def _check_range(self, start: int, length: int) -> None:
        if start < 0 or length < 0:
            raise ValueError(f"read_range needs start >= 0 and length >= 0, got {start}, {length}")


def is_name(name: str) -> bool:
    """Whether ``name`` names a file inside the root: relative, no ``.``/``..`` segment, and not a folder
    (an object store's zero-byte "folder marker" ``runs/exp/`` and the root itself, ``""``, are no files)."""
    return bool(name) and not name.startswith("/") and not name.endswith("/") and not any(
        p in ("..", ".") for p in name.split("/"))


def check_name(name: str) -> str:
    """``name`` if it is a relative path inside the root (no leading ``/``, no ``.``/``..``)."""
    if not name or name.startswith("/") or any(p in ("..", ".") for p in name.split("/")):
        raise ValueError(f"storage names are relative paths without '.'/'..', got {name!r}")
    return name
