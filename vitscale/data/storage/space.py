"""A full disk: recognising it whatever raised it, and how much room a path has left.

Used wherever vitscale writes something big (checkpoints: `train/checkpoint.py`; datasets:
`data/tools/publish.py`, `data/tools/adopt.py`) to end in one line naming the place and the space
needed instead of ``OSError: [Errno 28]`` with a traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from vitscale.config.location import is_url

__all__ = ["NO_SPACE_ERRNOS", "RESUMES", "free_bytes", "free_files", "free_text", "is_no_space", "no_space_line",
           "out_of_files", "resumes", "size_text"]

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""A full disk or an exceeded quota (of bytes or of files). Not ``EFBIG``: a file over the filesystem's or
the process's largest file size is not helped by freeing space, so it keeps its own words."""
RESUMES = "free space there and run again: it resumes from the last complete checkpoint"
"""How every full-disk line of a run ends: what to do, and what the run does then (`resumes`)."""
NO_FILES = "no free inodes (files) left"
"""What a filesystem whose inodes ran out is short of: bytes may be free, but no file can be created."""
_NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded", "[errno 28]", "[errno 122]")


def is_no_space(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it wraps) is a full disk or an exceeded quota.

    pyarrow's copies (Ray's checkpoint upload) raise an ``OSError`` without ``errno`` whose text
    carries it, so the text is read too.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return True
        if any(t in str(exc).lower() for t in _NO_SPACE_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _existing(path: str | os.PathLike[str]) -> Path | None:
    """The nearest existing folder of ``path`` (itself or a parent); None for a URL."""
    text = os.fspath(path)
    if is_url(text) and not text.startswith("file://"):
        return None
    current = Path(text.removeprefix("file://")).expanduser()
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent); None for a URL."""
    current = _existing(path)
    try:
        return None if current is None else shutil.disk_usage(current).free
    except OSError:
        return None


def free_files(path: str | os.PathLike[str]) -> int | None:
    """Files (inodes) that can still be created on the filesystem holding ``path``; None for a URL, or
    for a filesystem that has no fixed number of them (it reports 0 in all: btrfs, some network ones)."""
    current = _existing(path)
    try:
        stats = None if current is None else os.statvfs(current)
    except OSError:
        return None
    return None if stats is None or stats.f_files == 0 else stats.f_favail


def out_of_files(path: str | os.PathLike[str]) -> bool:
    """Whether the filesystem holding ``path`` can create no more files (its inodes ran out)."""
    return free_files(path) == 0


def free_text(where: str | os.PathLike[str], free: int | None) -> str:
    """What is free at ``where`` for a message: ``41.6 MB free``, and when its inodes ran out
    ``no free inodes (files) left, 41.6 MB free``: bytes free are no use when no file can be made."""
    has = f"{size_text(free)} free" if free is not None else "free space unknown"
    return f"{NO_FILES}, {has}" if out_of_files(where) else has


def resumes(where: str | os.PathLike[str]) -> str:
    """How a run's full-disk line ends (`RESUMES`), asking for files removed where inodes ran out."""
    return RESUMES.replace("free space there", "remove files there", 1) if out_of_files(where) else RESUMES


def size_text(n: int | None) -> str:
    """``n`` bytes for a message, in the unit that shows it: ``512 bytes``, ``12.3 kB``, ``1,234.5 MB``
    ("an unknown amount" for None). The one size format of every message about space: an index of a
    few kilobytes must not read "0.0 MB"."""
    if n is None:
        return "an unknown amount"
    if n < 1000:
        return f"{n} byte" if n == 1 else f"{n} bytes"
    if n < 1_000_000:
        return f"{n / 1e3:.1f} kB"
    return f"{n / 1e6:,.1f} MB"


def no_space_line(where: str | os.PathLike[str], detail: str = "", *, needed: int | None = None) -> str:
    """The one line a run's full disk ends in (outside a checkpoint's own save, `train/checkpoint.py`):
    the path that did not fit, the space free there, the space the run needs to go on (``needed``: its
    next checkpoint, about the size of its last; unknown before the first), the error's own words."""
    need = (f"about {size_text(needed)} needed for the next checkpoint" if needed is not None
            else "the next checkpoint's size not known yet")
    tail = f": {detail}" if detail else ""
    return (f"no space left on the device of {os.fspath(where)} ({free_text(where, free_bytes(where))}, {need})"
            f"{tail}; {resumes(where)}")
