"""Ray's checkpoint downloads that killed readers left in the temporary folder, removed.

`ray.train.Checkpoint.as_directory()` downloads a checkpoint in object storage into
`<tmp>/checkpoint_tmp_<uuid>` and marks each process reading it with an empty
`checkpoint_tmp_<uuid>.del_lock_<pid>` file; the last reader to leave removes the folder. A reader SIGKILLed
meanwhile (a rank killed while it resumed: the OOM killer, a lost peer's teardown) never removes its mark, and Ray
keeps the folder, a whole checkpoint, for good; on a node whose ranks are killed while resuming again and again,
one per attempt. Before a worker fetches the checkpoint it resumes from, it removes the folders whose every mark
names a process that is gone, holding Ray's own lock of the folder (the one its downloads and removals take):
a live reader's folder, a folder being downloaded, and a folder with no mark (`to_directory()`'s, which its
caller keeps) are never touched. Ray's internals, read here and only here (`ray.train._checkpoint`, 2.60).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from vitscale.data.storage.holder import no_such_process

PREFIX = "checkpoint_tmp_"
"""Ray's `_CHECKPOINT_TEMP_DIR_PREFIX`."""
MARK = ".del_lock_"
"""Between a download's folder name and its reader's pid (Ray's `_get_del_lock_path`)."""


def _readers(folder: Path) -> dict[Path, int | None]:
    """`folder`'s reader marks, each with the pid it names (None: a mark that names no pid)."""
    marks = folder.parent.glob(f"{folder.name}{MARK}*")
    return {mark: int(pid) if (pid := mark.name[len(folder.name) + len(MARK):]).isdigit() else None
            for mark in marks}


def _gone(pid: int | None) -> bool:
    return pid is not None and no_such_process(pid)


def abandoned(folder: Path) -> bool:
    """Whether every reader `folder`'s marks name is gone (False without a mark, or with one not naming a pid)."""
    readers = _readers(folder)
    return bool(readers) and all(_gone(pid) for pid in readers.values())


def remove_abandoned_downloads(where: str | None = None) -> list[str]:
    """Remove the abandoned downloads in `where` (the temporary folder, as Ray's); returns their names."""
    from ray.air._internal.filelock import TempFileLock

    removed = []
    for folder in sorted(Path(where or tempfile.gettempdir()).glob(f"{PREFIX}*")):
        if MARK in folder.name or not folder.is_dir() or not abandoned(folder):
            continue
        # Timeout: a download or a removal of it runs now; OSError: gone meanwhile. Left alone either way.
        with contextlib.suppress(TimeoutError, OSError), TempFileLock(str(folder), timeout=0):
            if not abandoned(folder):  # a reader came meanwhile
                continue
            shutil.rmtree(folder)
            for mark, pid in _readers(folder).items():
                if _gone(pid):  # not the mark of a reader come since
                    mark.unlink(missing_ok=True)
            removed.append(folder.name)
    return removed
