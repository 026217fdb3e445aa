"""A run interrupted (Ctrl-C, SIGTERM, SIGHUP) while Ray Train runs it: the workers stopped, then the CLI's ending.

Ray Train's ``fit`` replaces the driver's SIGINT handler with its own for the length of the run, and
never puts the previous one back: on Ctrl-C it aborts the run's controller and calls ``sys.exit(0)``
(the process still ends with status 1), so ``vitscale run`` ended silently instead of saying where the
run is kept and how to resume it, and a Ctrl-C in a later stage met a handler aimed at a finished run.
And ``ray.init`` gives the driver Ray's own SIGTERM handler, which prints a stack dump and aborts: a
scheduler's stop (``ray job stop``, ``timeout``, a deleted pod) left a crash on the terminal, the run's
lease held and its files unpushed.

:class:`InterruptibleTrainer` first asks the workers to checkpoint at their next step and end
(`launch/stop_request.py`): a resume then redoes no step. A second signal, or workers that have not ended
within the run's grace, abort the run as Ray does (the workers stop, the complete checkpoints stay). Then
it hands the signal to the handler in place before the run: Python's ``KeyboardInterrupt`` for SIGINT, the
CLI's for SIGTERM and SIGHUP (``cli/interrupt.py``), which unwind and end in one line. When ``fit``
returns or raises, those handlers are back. :func:`keeping_handlers` puts them back after ``ray.init``.

Runs driven side by side from threads (a sweep's final retrains) get no such handler: Ray registers
it from the main thread only. :func:`side_by_side` runs them in daemon threads, so a Ctrl-C in the
main thread is not held up until they finish (a thread pool's workers are joined at exit): the driver
ends, and the Train runs it drove end with it, as every actor a driver owns does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, TypeVar

import ray

from vitscale.launch.no_datasets import TrainerWithoutDatasets
from vitscale.launch.stop_request import stop_grace
from vitscale.say import say

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


class InterruptibleTrainer(TrainerWithoutDatasets):
    """A ``TorchTrainer`` whose Ctrl-C, SIGTERM or SIGHUP stops the run, then the driver.

    With ``stop`` (this driver's `StopRequests` actor, the run's key and its grace in seconds), the first
    signal asks the workers to checkpoint at their next step and end (`launch/stop_request.py`), so a resume
    redoes no step; the run is aborted if they have not ended within the grace, or at a second signal.
    Without it, the first signal aborts at once.
    """

    def __init__(self, *args: Any, stop: tuple[Any, str, float] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stop = stop
        self._asked: tuple[int, FrameType | None] | None = None  # the signal that asked the run to stop
        self._before: dict[int, Any] = {}
        self._deadline: threading.Timer | None = None  # aborts a stop the workers have not honoured in time

    def fit(self) -> Any:
        try:
            with keeping_handlers():  # Ray's handler goes with the run (Tune fits from its own threads: none)
                result = super().fit()
        except Exception:
            if self._asked is None:
                raise
            result = None  # aborted after the grace: the run stopped regardless
        finally:
            if self._deadline is not None:
                self._deadline.cancel()
        if self._asked is not None:  # the workers checkpointed and ended: now the driver ends, as it was told
            _hand_on(self._before, *self._asked)
        return result

    # Ray Train calls this hook (from the main thread only) once the run's controller exists.
    def _register_sigint_handler(self, controller: Any) -> None:
        before = self._before = _handlers()

        def abort(signum: int, frame: FrameType | None) -> None:
            _restore(before)  # a second signal is not held up by the abort
            _abort(controller)
            _hand_on(before, signum, frame)

        def ask(signum: int, frame: FrameType | None) -> None:
            assert self._stop is not None
            requests, run, configured = self._stop
            grace = stop_grace(configured, os.environ)
            why = f"the run was asked to stop ({signal.Signals(signum).name} to the driver)"
            try:
                stepping = grace > 0 and ray.get(requests.ask.remote(run, why), timeout=10)
            except Exception:  # noqa: BLE001 -- the request could not be made: stop as before asking existed
                stepping = False
            # No worker has made a step yet (nothing to checkpoint, nothing to wait for), or no time to wait.
            if not stepping:
                abort(signum, frame)
            self._asked = (signum, frame)
            for again in before:
                if signal.getsignal(again) is ask:
                    signal.signal(again, abort)
            self._deadline = threading.Timer(grace, _abort, args=(controller,))
            self._deadline.daemon = True
            self._deadline.start()
            say(f"stopping: the workers checkpoint at their next step, then end (aborted after {grace:.0f} s; "
                "Ctrl-C again to stop at once)")

        for signum, handler in before.items():
            # An ignored signal stays ignored (`nohup`); one set outside Python could not be put back after.
            if handler is not signal.SIG_IGN and handler is not None:
                signal.signal(signum, ask if self._stop is not None else abort)


def _abort(controller: Any) -> None:
    with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        # The controller stops the workers and exits: its own call ends with its death.
        ray.get(controller.abort.remote(), timeout=ABORT_WAIT_S)


def _hand_on(before: dict[int, Any], signum: int, frame: FrameType | None) -> None:
    """The signal to the handler in place before the run: KeyboardInterrupt, or the CLI's `Signalled`."""
    previous = before.get(signum)
    if callable(previous):
        previous(signum, frame)
    raise KeyboardInterrupt  # SIG_DFL, or a handler that returned: the run has stopped regardless


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
