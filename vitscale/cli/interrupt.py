"""SIGTERM and SIGHUP to a verb that writes files: an interruption, cleaned up as Ctrl-C is.

Python ends on SIGTERM or SIGHUP without unwinding: no ``except``/``finally`` runs, so a ``shards
write`` killed by ``kill``, a closed terminal or a scheduler's stop would leave its half-written
shards, marker and lease behind. A verb marked :func:`writes` turns both signals into
:class:`Signalled`, a ``KeyboardInterrupt``: the very path Ctrl-C takes (``publish.abort`` removes what
the write put there, and the folders it created), then one line and the shell's exit code for the
signal, ``128 + signum`` (143 for SIGTERM, 129 for SIGHUP).

Only the CLI process of such a verb, only while its command runs, and the handlers in place before are
restored afterwards. ``vitscale run`` and ``finetune`` are marked too: their driver stops the run's
workers first (``launch/interruption.py``) and its line says how to resume. A SIGTERM to a *worker* is another
matter, a preemption notice (``train/termination.py``): workers are processes of their own.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["SIGNALS", "Signalled", "as_interruptions", "is_writing", "received", "writes"]

SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that ask a process to end (``kill``, a closed terminal, a job scheduler), besides Ctrl-C's SIGINT."""

_MARK = "_vitscale_writes"
_received: int | None = None


def received() -> int:
    """The signal that interrupted the command: SIGTERM or SIGHUP taken by :func:`as_interruptions`, else
    SIGINT. Ray's ``get`` turns whatever a handler raised while it waited into a plain ``KeyboardInterrupt``,
    so a :class:`Signalled` may arrive without its number."""
    return signal.SIGINT if _received is None else _received


class Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP received: the command stops and cleans up as after Ctrl-C."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by this signal: 128 + its number."""
        return 128 + self.signum


def writes(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Mark a verb's command as one that writes files: SIGTERM and SIGHUP end it as Ctrl-C does."""
    setattr(command, _MARK, True)
    return command


def is_writing(command: Callable[[argparse.Namespace], int]) -> bool:
    """Whether ``command`` was marked with :func:`writes`."""
    return bool(getattr(command, _MARK, False))


@contextmanager
def as_interruptions(enabled: bool = True) -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise :class:`Signalled` in the main thread (when ``enabled``).

    A second one while the first is being cleaned up is ignored, so the clean-up is not cut short
    (SIGKILL still ends the process); the handlers in place before are restored on the way out. A signal
    this process was started ignoring stays ignored: `nohup vitscale run ... &` outlives its terminal.
    """
    global _received
    _received = None
    if not enabled:
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        global _received
        _received = signum
        for other in SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        raise Signalled(signum)

    before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    for signum, handler in before.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, interrupt)
    try:
        yield
    finally:
        for signum, handler in before.items():
            if handler is not None:  # None: set outside Python, which cannot be put back
                signal.signal(signum, handler)
