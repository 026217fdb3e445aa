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

__all__ = ["NO_SPACE_ERRNOS", "RESUMES", "free_bytes", "is_no_space", "megabytes", "no_space_line"]

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
RESUMES = "free space there and run again: it resumes from the last complete checkpoint"
"""How every full-disk line of a run ends: what to do, and what the run does then."""
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


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent); None for a URL."""
    text = os.fspath(path)
    if is_url(text) and not text.startswith("file://"):
        return None
    current = Path(text.removeprefix("file://")).expanduser()
    while not current.exists() and current != current.parent:
        current = current.parent
    try:
        return shutil.disk_usage(current).free
    except OSError:
        return None


def megabytes(n: int | None) -> str:
    """``n`` bytes for a message ("unknown" for None)."""
    return "an unknown amount" if n is None else f"{n / 1e6:,.1f} MB"


def no_space_line(where: str | os.PathLike[str], detail: str = "", *, needed: int | None = None) -> str:
    """The one line a run's full disk ends in (outside a checkpoint's own save, `train/checkpoint.py`):
    the path that did not fit, the space free there, the space the run needs to go on (``needed``: its
    next checkpoint, about the size of its last; unknown before the first), the error's own words."""
    need = (f"about {megabytes(needed)} needed for the next checkpoint" if needed is not None
            else "the next checkpoint's size not known yet")
    tail = f": {detail}" if detail else ""
    free = megabytes(free_bytes(where))
    return f"no space left on the device of {os.fspath(where)} ({free} free, {need}){tail}; {RESUMES}"
