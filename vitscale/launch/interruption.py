"""A run interrupted (Ctrl-C, SIGTERM, SIGHUP) while Ray Train runs it: the workers stopped, then the CLI's ending.

Ray Train's ``fit`` replaces the driver's SIGINT handler with its own for the length of the run, and
never puts the previous one back: on Ctrl-C it aborts the run's controller and calls ``sys.exit(0)``
(the process still ends with status 1), so ``vitscale run`` ended silently instead of saying where the
run is kept and how to resume it, and a Ctrl-C in a later stage met a handler aimed at a finished run.
And ``ray.init`` gives the driver Ray's own SIGTERM handler, which prints a stack dump and aborts: a
scheduler's stop (``ray job stop``, ``timeout``, a deleted pod) left a crash on the terminal, the run's
lease held and its files unpushed.

:class:`InterruptibleTrainer` keeps Ray's abort (the workers stop, the complete checkpoints stay) and then hands
the signal to the handler in place before the run: Python's ``KeyboardInterrupt`` for SIGINT, the
CLI's for SIGTERM and SIGHUP (``cli/interrupt.py``), which unwind and end in one line. A second
signal during the abort goes straight to that handler. When ``fit`` returns or raises, those handlers
are back. :func:`keeping_handlers` puts them back after ``ray.init``.

Runs driven side by side from threads (a sweep's final retrains) get no such handler: Ray registers
it from the main thread only. :func:`side_by_side` runs them in daemon threads, so a Ctrl-C in the
main thread is not held up until they finish (a thread pool's workers are joined at exit): the driver
ends, and the Train runs it drove end with it, as every actor a driver owns does.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, TypeVar

import ray
from ray.train.torch import TorchTrainer

__all__ = ["ABORT_WAIT_S", "STOPS", "InterruptibleTrainer", "keeping_handlers", "side_by_side"]

T = TypeVar("T")

ABORT_WAIT_S = 60.0
"""How long a Ctrl-C waits for Ray Train to stop the workers before the driver goes on ending."""


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that end a driver: Ctrl-C, a scheduler's or ``kill``'s stop, a closed terminal."""


def _handlers() -> dict[int, Any]:
    return {signum: signal.getsignal(signum) for signum in STOPS}


def _restore(handlers: dict[int, Any]) -> None:
    for signum, handler in handlers.items():
        if handler is not None:  # None: set outside Python, which cannot be put back
            signal.signal(signum, handler)


@contextlib.contextmanager
def keeping_handlers() -> Iterator[None]:
    """Inside (``ray.init``), whatever installs its own handlers for :data:`STOPS`; after, this driver's again."""
    main = threading.current_thread() is threading.main_thread()
    before = _handlers() if main else {}
    try:
        yield
    finally:
        _restore(before)


class InterruptibleTrainer(TorchTrainer):
    """A ``TorchTrainer`` whose Ctrl-C, SIGTERM or SIGHUP stops the run's workers, then the driver."""

    def fit(self) -> Any:
        with keeping_handlers():  # Ray's handler goes with the run (Tune fits from its own threads: none)
            return super().fit()

    # Ray Train calls this hook (from the main thread only) once the run's controller exists.
    def _register_sigint_handler(self, controller: Any) -> None:
        before = _handlers()

        def stop(signum: int, frame: FrameType | None) -> None:
            _restore(before)  # a second signal is not held up by the abort
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                # The controller stops the workers and exits: its own call ends with its death.
                ray.get(controller.abort.remote(), timeout=ABORT_WAIT_S)
            previous = before[signum]
            if callable(previous):
                previous(signum, frame)  # KeyboardInterrupt, or the CLI's Signalled
            raise KeyboardInterrupt  # SIG_DFL, or a handler that returned: the run has stopped regardless

        for signum, handler in before.items():
            # An ignored signal stays ignored (`nohup`); one set outside Python could not be put back after.
            if handler is not signal.SIG_IGN and handler is not None:
                signal.signal(signum, stop)


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
