"""Which checkpoint a Ray Train worker resumes from: the newest complete one, wherever it was recorded.

Ray hands a restarted worker the latest checkpoint it registered; a run's storage may hold a newer one (a
worker that died right after its upload) or show the latest incomplete (a rank that died while uploading).
`resume_directory` takes the newer of the two and falls back, newest first, to a complete one; every rank
then agrees on rank 0's step (`agree_on_resume`). Storage that cannot be read is an error, never a run
without checkpoints.
"""

from __future__ import annotations

import contextlib
import posixpath
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray.train
from ray.train.collective import broadcast_from_rank_zero

from vitscale.data.storage.base import StorageError
from vitscale.data.storage.filesystem import run_filesystem
from vitscale.data.storage.retry import final_reason
from vitscale.launch.abandoned_downloads import remove_abandoned_downloads
from vitscale.say import say
from vitscale.train import checkpoint as ckpt

__all__ = ["agree_on_resume", "newest_in_storage", "resume_directory"]


def resume_directory(world_size: int, rank: int, downloads: contextlib.ExitStack,
                      storage: str | None = None) -> Path | None:
    """The newest COMPLETE checkpoint of this run as a local directory, or None for a fresh start.

    The newer of the latest checkpoint Ray hands back and the newest in the run's storage (a worker
    that died right after its upload, a rank that left on SIGTERM, leaves a checkpoint Ray may never
    have registered; a re-submitted run must not start from scratch or step back past it). If the latest is
    incomplete (a rank died while uploading, a damaged manifest), older checkpoints are searched in
    the run's storage itself
    (a local folder, NFS or object storage: never a temporary download folder). A copy fetched
    from object storage stays until `downloads` is closed; incomplete ones are released at once.
    A checkpoint written by another world size is handed on as it is: the loop reshards it (an
    elastic run) or refuses it naming the change (`train/resume.py`), never falls back past it.

    When the storage shows every checkpoint incomplete (the first upload failed part-way), the run starts
    from step 1, saying which it ignores: its saves of those steps write them again. Storage that cannot be
    read (listed or downloaded) is never taken for a run without checkpoints: that raises a
    :class:`StorageError` naming the place, and the run does not start over.
    """
    known = [c for c in (ray.train.get_checkpoint(), newest_in_storage(storage)) if c is not None]
    if not known:
        return None
    latest = max(known, key=lambda c: posixpath.basename(c.path.rstrip("/")))  # checkpoint_{step:09d}
    if not isinstance(latest.filesystem, pyarrow.fs.LocalFileSystem):  # as_directory() downloads it, below
        removed = remove_abandoned_downloads()
        if removed:
            say(f"rank {rank}: removed {len(removed)} checkpoint download(s) that killed processes left in "
                f"{tempfile.gettempdir()}: {', '.join(removed)}")
    ignored: list[str] = []
    for candidate in _newest_first(latest):
        name = posixpath.basename(candidate.path.rstrip("/"))
        fetched = contextlib.ExitStack()
        try:
            directory = Path(fetched.enter_context(candidate.as_directory()))
        except FileNotFoundError:  # the storage says it is gone (deleted since Ray recorded it)
            fetched.close()
            ignored.append(f"{name} (not in storage)")
            continue
        except (OSError, ValueError) as exc:
            fetched.close()
            raise _unreadable(f"cannot read checkpoint {_url(candidate)}", exc) from exc
        info = ckpt.manifest_info(directory)
        # Complete as its writers left it (the loop reshards one of another world size, or refuses it).
        saved_world = info[1] if info is not None else world_size
        found = ckpt.check_complete(directory, saved_world, hash_ranks={0, rank if rank < saved_world else 0})
        if not found:
            downloads.callback(fetched.close)
            if candidate is not latest:
                say(f"latest checkpoint {posixpath.basename(latest.path)} is incomplete; "
                      f"resuming from {name}")
            return directory
        fetched.close()
        more = f"; {len(found) - 1} more problem(s)" if len(found) > 1 else ""
        ignored.append(f"{name} ({found[0].replace(f'{directory}/', '').replace(str(directory), name)}{more})")
    if rank == 0:
        say(f"no complete checkpoint to resume from: starting from step 1, ignoring {len(ignored)} incomplete: "
            + ", ".join(ignored))
    return None


def agree_on_resume(rank: int, resume_from: Path | None) -> None:
    """Every rank resumes from rank 0's step, or the attempt fails in one line. Each rank checks the hashes of
    the files it reads (`resume_directory`), so a rank whose own part of the newest checkpoint is damaged
    chooses an older one, or none, and would train from another step than its peers. A barrier."""
    info = ckpt.manifest_info(resume_from) if resume_from is not None else None
    step = info[0] if info is not None else 0
    chosen = broadcast_from_rank_zero(step)
    if step != chosen:
        raise RuntimeError(f"rank {rank} found no complete checkpoint at step {chosen}, from which rank 0 resumes "
                           f"(its own files of it are missing or damaged: see its lines above); it would resume "
                           f"from step {step}")


def _url(checkpoint: Any) -> str:
    """A checkpoint's address for messages: `s3://bucket/...` on object storage, else its path."""
    s3 = isinstance(checkpoint.filesystem, pyarrow.fs.S3FileSystem)
    return ("s3://" if s3 else "") + checkpoint.path


def _unreadable(what: str, exc: BaseException) -> StorageError:
    """`what` failed reading the run's storage: one line with the storage's error; final as that error is
    (data/storage/retry.py: a refusal, or one that outlasted the retry budget)."""
    why = final_reason(exc)
    return StorageError(f"{what}: {' '.join(str(exc).split())[:300] or type(exc).__name__}"
                        + (f" ({why})" if why else ""), final=why is not None)


def newest_in_storage(storage: str | None) -> Any:
    """The newest `checkpoint_*` folder in the run's storage as a `ray.train.Checkpoint`, or None (none there).
    A storage that cannot be listed raises a `StorageError`: it is not a run without checkpoints."""
    if storage is None:
        return None
    filesystem, path = run_filesystem(storage)
    if filesystem is None:
        filesystem, path = pyarrow.fs.LocalFileSystem(), storage
    try:
        infos = filesystem.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    except (OSError, ValueError) as exc:
        raise _unreadable(f"cannot list the checkpoints of {storage}", exc) from exc
    names = [posixpath.basename(i.path) for i in infos
             if i.type == pyarrow.fs.FileType.Directory and posixpath.basename(i.path).startswith("checkpoint_")]
    if not names:
        return None
    return ray.train.Checkpoint(posixpath.join(path, max(names)), filesystem=filesystem)


def _newest_first(latest: Any) -> Iterator[Any]:
    """`latest`, then the run's other `checkpoint_*` folders beside it in storage, newest first."""
    yield latest
    parent = posixpath.dirname(latest.path.rstrip("/"))
    try:
        infos = latest.filesystem.get_file_info(pyarrow.fs.FileSelector(parent))
    except (OSError, ValueError) as exc:
        raise _unreadable(f"cannot list the checkpoints beside {_url(latest)}", exc) from exc
    folders = (posixpath.basename(i.path) for i in infos if i.type == pyarrow.fs.FileType.Directory)
    names = sorted((name for name in folders if name.startswith("checkpoint_")),
                   reverse=True)  # checkpoint_{step:09d}: the name orders by step
    for name in names:
        path = posixpath.join(parent, name)
        if path.rstrip("/") != latest.path.rstrip("/"):
            yield ray.train.Checkpoint(path, filesystem=latest.filesystem)
