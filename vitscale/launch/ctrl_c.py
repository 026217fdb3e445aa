"""Ctrl-C during a Ray Train run: the workers stopped, then the ``KeyboardInterrupt`` the CLI answers.

Ray Train's ``fit`` replaces the driver's SIGINT handler with its own for the length of the run, and
never puts the previous one back: on Ctrl-C it aborts the run's controller and calls ``sys.exit(0)``
(the process still ends with status 1), so ``vitscale run`` ended silently instead of saying where the
run is kept and how to resume it, and a Ctrl-C in a later stage met a handler aimed at a finished run.

:class:`Trainer` keeps Ray's abort (the workers stop, the complete checkpoints stay) and then raises
``KeyboardInterrupt``, the path every other Ctrl-C takes; a second Ctrl-C during the abort goes to the
handler in place before the run. When ``fit`` returns or raises, that handler is back.

Runs driven side by side from threads (a sweep's final retrains) get no such handler: Ray registers
it from the main thread only. :func:`side_by_side` runs them in daemon threads, so a Ctrl-C in the
main thread is not held up until they finish (a thread pool's workers are joined at exit): the driver
ends, and the Train runs it drove end with it, as every actor a driver owns does.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TypeVar

import ray
from ray.train.torch import TorchTrainer

__all__ = ["ABORT_WAIT_S", "Trainer", "side_by_side"]

T = TypeVar("T")

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


def side_by_side(calls: Sequence[Callable[[], T]], width: int) -> list[T]:
    """Each call's result, in order, running at most ``width`` at once in daemon threads.

    The first call (in order) that raised re-raises here once all have ended; a ``KeyboardInterrupt``
    in the waiting main thread leaves at once.
    """
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)
    gate = threading.Semaphore(max(1, width))

    def one(i: int) -> None:
        with gate:
            try:
                results[i] = calls[i]()
            except BaseException as exc:  # noqa: BLE001 -- handed to the main thread, raised there
                errors[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True, name=f"vitscale-run-{i}")
               for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # interruptible: Ctrl-C raises here
    for error in errors:
        if error is not None:
            raise error
    return results
