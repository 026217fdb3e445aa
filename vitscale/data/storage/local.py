"""Local-folder storage: plain files, written atomically (data/storage/atomic.py: a hidden part file, renamed)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import BinaryIO

from vitscale.data.storage.atomic import PART_SUFFIX, atomic_path, write_atomic
from vitscale.data.storage.base import Storage, check_name

__all__ = ["LocalStorage"]


class LocalStorage(Storage):
    """A dataset in a local folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    def _path(self, name: str) -> Path:
        return self.root / check_name(name)

    def read_bytes(self, name: str) -> bytes:
        return self._path(name).read_bytes()

    def read_range(self, name: str, start: int, length: int) -> bytes:
        self._check_range(start, length)
        with open(self._path(name), "rb") as f:
            f.seek(start)
            return f.read(length)

    def open_read(self, name: str) -> BinaryIO:
        return open(self._path(name), "rb")

    def size(self, name: str) -> int:
        return self._path(name).stat().st_size

    def write_bytes(self, name: str, data: bytes) -> None:
        # Written whole or not at all (data/storage/atomic.py): a reader never sees a half-written shard or index.
        write_atomic(self._path(name), data)

    def write_file(self, name: str, local_path: str | os.PathLike[str]) -> None:
        with atomic_path(self._path(name)) as tmp:
            shutil.copyfile(local_path, tmp)

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        if not self.root.is_dir():
            return {}
        sizes = {}
        root = str(self.root)
        for dirpath, _, files in os.walk(root):
            # Plain strings, not a Path per file: a JFT-sized dataset lists 30k shards at every start.
            folder = os.path.relpath(dirpath, root)
            folder = "" if folder == "." else folder.replace(os.sep, "/") + "/"
            for f in files:
                if f.endswith(PART_SUFFIX) and f.startswith("."):
                    continue  # an in-flight atomic write
                rel = folder + f
                if rel.startswith(prefix):
                    try:
                        sizes[rel] = os.stat(os.path.join(dirpath, f)).st_size
                    except FileNotFoundError:
                        continue  # removed while we listed
        return dict(sorted(sizes.items()))

    def delete(self, name: str) -> None:
        self._path(name).unlink()

    def rename(self, src: str, dst: str) -> None:
        target = self._path(dst)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._path(src), target)

    def url_of(self, name: str) -> str:
        return str(self._path(name))
