"""Ctrl-C during a Ray Train run: the workers stopped, then the ``KeyboardInterrupt`` the CLI answers.

Ray Train's ``fit`` replaces the driver's SIGINT handler with its own for the length of the run, and
never puts the previous one back: on Ctrl-C it aborts the run's controller and calls ``sys.exit(0)``
(the process still ends with status 1), so ``vitscale run`` ended silently instead of saying where the
run is kept and how to resume it, and a Ctrl-C in a later stage met a handler aimed at a finished run.

:class:`Trainer` keeps Ray's abort (the workers stop, the complete checkpoints stay) and then raises
``KeyboardInterrupt``, the path every other Ctrl-C takes; a second Ctrl-C during the abort goes to the
handler in place before the run. When ``fit`` returns or raises, that handler is back.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Any

import ray
from ray.train.torch import TorchTrainer

__all__ = ["ABORT_WAIT_S", "Trainer"]

ABORT_WAIT_S = 60.0
"""How long a Ctrl-C waits for Ray Train to stop the workers before the driver goes on ending."""


class Trainer(TorchTrainer):
    """A ``TorchTrainer`` whose Ctrl-C stops the run's workers and raises ``KeyboardInterrupt``."""

    def fit(self) -> Any:
        main = threading.current_thread() is threading.main_thread()  # Tune fits from its own threads
        before = signal.getsignal(signal.SIGINT) if main else None
        try:
            return super().fit()
        finally:
            if main and before is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(signal.SIGINT, before)

    # Ray Train calls this hook (from the main thread only) once the run's controller exists.
    def _register_sigint_handler(self, controller: Any) -> None:
        before = signal.getsignal(signal.SIGINT)

        def interrupt(signum: int, frame: FrameType | None) -> None:
            if before is not None:
                signal.signal(signal.SIGINT, before)  # a second Ctrl-C is not held up by the abort
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                # The controller stops the workers and exits: its own call ends with its death.
                ray.get(controller.abort.remote(), timeout=ABORT_WAIT_S)
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, interrupt)
