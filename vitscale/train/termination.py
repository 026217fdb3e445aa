"""SIGTERM to a worker as a notice to checkpoint, not an order to die mid-step.

A spot VM's shutdown, a kubelet deleting a pod, `kill PID`: each sends SIGTERM and waits a grace
period before SIGKILL. A Ray worker's own handler exits at once (SystemExit in its main thread),
losing every step since the last periodic checkpoint. `TerminationNotice` holds the signal back for
the training loop: the loop sees `notice()` at its next step, every rank checkpoints at that step,
and `leave()` then ends the process the way the signal would have.

Why faulthandler: the training loop runs in a thread Ray starts, and `signal.signal` works only in
the main thread. `faulthandler.register` installs a C-level handler from any thread; its "traceback
dump" goes into a pipe this module watches, which is all the notice needs, and `chain=False` keeps
the previous handler (Ray's exit) from running until `leave()` puts it back. The dump is written
with non-blocking writes, so a burst of signals can never block inside the handler.

If no checkpoint follows within `grace_s` (a step that never ends, a collective waiting on a dead
peer), the process leaves anyway: SIGTERM still ends the process, at most `grace_s` later than Ray's own handler would.
"""

from __future__ import annotations

import faulthandler
import fcntl
import os
import select
import signal
import threading
import time
from types import TracebackType
from typing import TextIO

from vitscale.say import say


class Terminated(RuntimeError):
    """This rank stops: it (`signalled`) or a peer was told to stop (SIGTERM), and the run's checkpoint at
    `step` holds everything up to it. A peer stops too rather than start a step the told rank will never
    join (its collective would fail, or with NCCL wait, until Ray Train tore the group down)."""

    def __init__(self, notice: str, step: int, *, signalled: bool):
        super().__init__(f"{notice}; checkpointed at step {step}")
        self.step = step
        self.signalled = signalled


class TerminationNotice:
    """Catches SIGTERM while entered (process-wide; one at a time); see the module's doc."""

    def __init__(self, grace_s: float, *, label: str = "this worker"):
        self.grace_s = grace_s
        self.label = label
        self._received_at: float | None = None
        self._left = threading.Event()
        self._closed = threading.Event()  # left, or the context exited: the grace watch is over
        self._marking = threading.Lock()
        self._read_fd = self._write_fd = -1
        self._sink: TextIO | None = None  # the pipe's write end, as the file object faulthandler keeps

    def __enter__(self) -> TerminationNotice:
        self._read_fd, self._write_fd = os.pipe()
        flags = fcntl.fcntl(self._write_fd, fcntl.F_GETFL)
        fcntl.fcntl(self._write_fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        self._sink = sink = os.fdopen(self._write_fd, "w")
        faulthandler.register(signal.SIGTERM, file=sink, all_threads=False, chain=False)
        threading.Thread(target=self._watch, name="vitscale-sigterm", daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._restore()

    def notice(self) -> str | None:
        """One line if SIGTERM arrived, else None (cheap: the loop asks every step)."""
        if self._received_at is None and not self._closed.is_set() and self._pending():
            self._mark()
        if self._received_at is None:
            return None
        return f"{self.label} received SIGTERM {time.monotonic() - self._received_at:.0f} s ago"

    def leave(self) -> None:
        """End the process the way SIGTERM would have (the handler held back is put back and the signal
        sent again); returns only where that handler does not end it (then the caller raises)."""
        if self._left.is_set():
            return
        self._left.set()
        self._restore()
        os.kill(os.getpid(), signal.SIGTERM)

    def _watch(self) -> None:
        # Blocks until the first SIGTERM writes its dump, or returns b"" once _restore closed the write end.
        signalled = os.read(self._read_fd, 1)
        if signalled:
            self._mark()
        else:
            os.close(self._read_fd)
            return
        if not self._closed.wait(self.grace_s):
            say(f"{self.label}: no checkpoint within {self.grace_s:.0f} s of SIGTERM "
                  "(cluster.preemption_grace_s); leaving without one")
            self.leave()
        os.close(self._read_fd)

    def _pending(self) -> bool:
        # The handler's dump is in the pipe the moment the signal is handled, but the watcher thread may
        # not have run yet (a busy host starves it of the GIL for steps on end): the loop looks itself. The
        # dump is many bytes and the watcher reads one, so the pipe stays readable once it has arrived.
        readable, _, _ = select.select([self._read_fd], [], [], 0)
        return bool(readable)

    def _mark(self) -> None:
        with self._marking:
            if self._received_at is None:
                self._received_at = time.monotonic()

    def _restore(self) -> None:
        self._closed.set()
        if self._sink is None:
            return
        faulthandler.unregister(signal.SIGTERM)  # the previous handler (Ray's exit) is back
        sink, self._sink = self._sink, None
        sink.close()  # a watcher still waiting for the signal reads EOF and closes its end
