"""A run's storage is the truth; a node's disk is a cache of it.

On a cluster whose nodes have disks of their own (KubeRay pods, `ray up` VMs), the only medium they
share is the run's storage (`storage_path/run_name`, a folder or an `s3://` prefix). Whatever a run
writes on a node (the driver's config, summary, logs, tables and plots; a rank's metrics and
TensorBoard events) is written into a local folder first, as every tool does, and then *pushed* to
the run's storage; a machine that has never seen the run *pulls* what it needs from the storage.

A pull makes the cache what the storage holds: files the storage lacks are removed from the cache, and
files it holds at another size are downloaded again. So a writer pulls when it starts, before it writes
(the driver at the start of a run, each rank when its worker starts): nothing of a run deleted from the
storage, and nothing the storage never took, reaches a new run at the same place through a node's disk.

:class:`RunMirror` pairs the two places. Pushing uploads the files that changed since the last push
(by size and modification time), so calling it after every stage, every checkpoint and every few
seconds for logs costs one stat per file. Where the storage *is* the local folder (a local or NFS
`storage_path`), both directions are no-ops.

Names under `checkpoint_*/` are left out of both directions, at any depth: checkpoints are written to
the storage by Ray Train itself and read through `ray.train.Checkpoint`, the run's own (at its top) and
those of the Train runs inside it (`finetune/checkpoint_*`, `sweep/trials/<id>/checkpoint_*`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from vitscale.data.storage.atomic import PART_SUFFIX, write_atomic
from vitscale.data.storage.base import Storage, StorageError, is_name
from vitscale.data.storage.local import LocalStorage

__all__ = ["RunFileNotStored", "RunMirror"]

SKIPPED_PREFIXES = ("checkpoint_",)
"""Folder names a mirror never copies, at any depth: Ray Train's own checkpoint folders (and its bookkeeping)."""
SKIPPED_NAMES = ("checkpoint_manager_snapshot.json", ".validate_storage_marker", ".vitscale-lease")
"""Ray Train's bookkeeping and the run's lease (data/storage/lease.py): owned by their writers, never copied."""


class RunFileNotStored(StorageError):
    """A push failed: one of the run's own files (config, logs, metrics, TensorBoard) was not stored; the
    message names its URL and the storage's error. Final as the storage's error was."""


def _skipped(name: str) -> bool:
    # Every segment: a part of the run (its fine-tuning, a sweep trial) is a Ray Train run of its own.
    segments = name.split("/")
    return any(s.startswith(SKIPPED_PREFIXES) or s in SKIPPED_NAMES for s in segments) or name.endswith(PART_SUFFIX)


class RunMirror:
    """A local folder (the cache) kept in step with a run's storage (the truth)."""

    def __init__(self, local: str | os.PathLike[str], storage: Storage,
                 include: Callable[[str], bool] | None = None) -> None:
        """`include` picks the names this mirror pushes (default all): several writers (the driver, each
        rank) may share one node's folder, and each pushes only what it writes."""
        self.local = Path(local)
        self.storage = storage
        self.include = include
        self._pushed: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None

    @property
    def same_place(self) -> bool:
        """The storage is this very folder: nothing to copy either way."""
        if not isinstance(self.storage, LocalStorage):
            return False
        with contextlib.suppress(OSError):
            return Path(self.storage.root).resolve() == self.local.resolve()
        return False

    def push(self, names: Iterable[str] | None = None) -> list[str]:
        """Upload local files that are new or changed since the last push; returns their names.

        `names` limits the push to those files (relative to the local folder); default every file.
        """
        if self.same_place or not self.local.is_dir():
            return []
        with self._lock:
            pushed = []
            for name in sorted(self._local_names() if names is None else names):
                path = self.local / name
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue  # removed since it was listed (a rotated log)
                mark = (stat.st_size, stat.st_mtime_ns)
                if _skipped(name) or self._pushed.get(name) == mark or (self.include and not self.include(name)):
                    continue
                try:
                    self.storage.write_file(name, path)
                except StorageError as exc:
                    raise RunFileNotStored(str(exc), final=exc.final) from exc
                self._pushed[name] = mark
                pushed.append(name)
            return pushed

    def pull(self, prefix: str = "") -> list[str]:
        """Make the cache under `prefix` hold what the storage holds there (of this mirror's names); returns
        the names downloaded.

        Files the cache lacks or holds at another size are downloaded; files the storage lacks are removed
        from the cache (a run deleted from the storage, records the storage never took). Call it before this
        writer writes anything (at its start): what it wrote and had not pushed would be removed too.
        """
        if self.same_place:
            return []
        stored = {name: size for name, size in self.storage.list_sizes(prefix).items() if self._mine(name)}
        if self.local.is_dir():
            for name in self._local_names():
                if name.startswith(prefix) and name not in stored and self._mine(name):
                    self._remove(name)
        pulled = []
        for name, size in stored.items():
            path = self.local / name
            if path.is_file() and path.stat().st_size == size:
                continue
            write_atomic(path, self.storage.read_bytes(name))
            stat = path.stat()
            self._pushed[name] = (stat.st_size, stat.st_mtime_ns)  # what is there already need not go back
            pulled.append(name)
        return pulled

    def _mine(self, name: str) -> bool:
        """A name this mirror copies: a file (never a folder marker), not Ray Train's, of this writer's."""
        return is_name(name) and not _skipped(name) and (self.include is None or self.include(name))

    def _remove(self, name: str) -> None:
        """Remove the cache's `name`, then the folders it leaves empty (up to the cache itself)."""
        path = self.local / name
        path.unlink(missing_ok=True)
        self._pushed.pop(name, None)
        folder = path.parent
        while folder != self.local and self.local in folder.parents:
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break
            folder = folder.parent

    def push_every(self, seconds: float) -> None:
        """Push in a daemon thread every `seconds` until :meth:`close` (logs reach storage while running)."""
        if self.same_place or self._stop is not None:
            return
        self._stop = threading.Event()
        stop = self._stop

        def loop() -> None:
            while not stop.wait(seconds):
                with contextlib.suppress(Exception):  # a failed periodic push is retried by the next one
                    self.push()

        threading.Thread(target=loop, name="vitscale-run-mirror", daemon=True).start()

    def close(self) -> list[str]:
        """Stop the periodic push and push once more (what changed last)."""
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        return self.push()

    def _local_names(self) -> list[str]:
        out = []
        for root, dirs, files in os.walk(self.local):
            rel = Path(root).relative_to(self.local)
            dirs[:] = [d for d in dirs if not _skipped(d)]
            out += [(rel / f).as_posix() if rel != Path(".") else f for f in files]
        return out
