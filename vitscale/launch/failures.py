"""Which worker failures are worth a restart, and stopping the run at once for the others.

Ray Train V2 restarts the worker group after any worker error until `FailureConfig.max_failures`
is spent (forever with -1). That is right for a lost node or an out-of-memory kill, and wrong for
a failure that a restart repeats exactly: the same bad samples exceed the error budget again, the
same damaged dataset or setting is refused again. Ray Train V2 has no public hook to classify
worker errors, but it runs `UserCallback.after_exception` on its controller whenever workers
fail, and an exception raised from a controller callback is a `ControllerError`, which its
default failure policy never retries. `StopOnDeterministicFailure` raises there, so such a run
ends after its first attempt with the workers' own messages.
"""

from __future__ import annotations

from typing import Any

from ray.train.v2.api.callback import UserCallback

from vitscale.config.checks import ConfigError
from vitscale.data.format import DatasetError
from vitscale.data.loader.stream import ErrorBudgetExceeded
from vitscale.data.storage.space import NO_SPACE_ERRNOS
from vitscale.train.checkpoint import DiskFull
from vitscale.train.engine import UnsafeCheckpoint
from vitscale.train.loop import NonFiniteSteps

DETERMINISTIC: tuple[type[BaseException], ...] = (ErrorBudgetExceeded, DatasetError, ConfigError, NonFiniteSteps,
                                                   UnsafeCheckpoint, DiskFull)
"""Errors a restart repeats exactly (bad data, an exceeded error budget, a bad setting or a changed
run found on a worker, the non-finite-step budget spent, a checkpoint file that would run code, a
checkpoint that does not fit its disk):
the run stops instead of being retried."""


class DeterministicFailure(RuntimeError):
    """Workers failed in a way a restart would repeat; the message names each rank's error."""


def deterministic_cause(error: BaseException | None) -> BaseException | None:
    """The deterministic error behind ``error``, or None: the first in its cause chain that is of a
    `DETERMINISTIC` type or marked ``deterministic = True`` (the worker marks the `WorkerFailed`
    it raises, because pickling to the controller drops the cause chain). Ray's wrapper of a
    worker's exception is looked through."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, DETERMINISTIC) or getattr(error, "deterministic", False) is True:
            return error
        if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:  # any write into a full disk
            return error
        seen.add(id(error))
        error = getattr(error, "_base_exc", None) or error.__cause__ or error.__context__
    return None


class StopOnDeterministicFailure(UserCallback):
    """Ends the run, without a restart, when any worker's error is deterministic (see module doc)."""

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        found = {rank: deterministic_cause(exc) for rank, exc in worker_exceptions.items()}
        lines = [_line(rank, exc) for rank, exc in sorted(found.items()) if exc is not None]
        if lines:
            raise DeterministicFailure("; ".join(lines) + " (not retried: a restart would fail the same way)")


def _line(rank: int, exc: BaseException) -> str:
    text = str(exc)
    # The worker's own WorkerFailed already reads "rank R: Type: message".
    return text if text.startswith(f"rank {rank}:") else f"rank {rank}: {type(exc).__name__}: {text}"
