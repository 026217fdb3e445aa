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

__all__ = ["NO_SPACE_ERRNOS", "RESUMES", "free_bytes", "is_no_space", "no_space_line", "size_text"]

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
    free = size_text(free_bytes(where))
    return f"no space left on the device of {os.fspath(where)} ({free} free, {need}){tail}; {RESUMES}"
