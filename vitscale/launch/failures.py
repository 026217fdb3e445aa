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

import os
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import ray
from pydantic import ValidationError
from ray.train.v2._internal.constants import (
    DEFAULT_WORKER_GROUP_START_TIMEOUT_S,
    WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
)
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.controller.state import (
    InitializingState,
    PreemptingState,
    ReschedulingState,
    ResizingState,
    RestartingState,
    RunningState,
    SchedulingState,
)
from ray.train.v2.api.callback import UserCallback

from vitscale.config.checks import ConfigError
from vitscale.data.format import DatasetError
from vitscale.data.loader.stream import ErrorBudgetExceeded
from vitscale.data.storage.space import NO_SPACE_ERRNOS
from vitscale.launch.worker_wait import Shortfall, no_room_line, observe, out_of_wait, workers_that_fit
from vitscale.train.checkpoint import DiskFull
from vitscale.train.engine import UnsafeCheckpoint
from vitscale.train.loop import NonFiniteSteps
from vitscale.train.worker import StreamMismatch

DETERMINISTIC: tuple[type[BaseException], ...] = (ErrorBudgetExceeded, DatasetError, ConfigError, NonFiniteSteps,
                                                   UnsafeCheckpoint, DiskFull, ValidationError, StreamMismatch)
"""Errors a restart repeats exactly (bad data, an exceeded error budget, a bad setting or a changed
run found on a worker, a checkpoint whose stream position this run's sample order does not imply, the
non-finite-step budget spent, a checkpoint file that would run code, a
checkpoint that does not fit its disk, a config DeepSpeed's pydantic models refuse as a worker builds its
engine, which the pipeline's own check reads the same way first: `train/engine.py` `check_settings`):
the run stops instead of being retried."""


class DeterministicFailure(RuntimeError):
    """Workers failed in a way a restart would repeat; the message names each rank's error, `tracebacks` holds
    where they were raised (`alike`: ranks that failed alike share one; an attribute survives the pickling to
    the driver, which the workers' exceptions, not carried by the controller's error, would not)."""

    def __init__(self, message: str, tracebacks: list[tuple[tuple[int, ...], str]] | None = None) -> None:
        super().__init__(message)
        self.tracebacks = list(tracebacks or [])


MOST_TRACEBACKS = 8
"""Distinct tracebacks kept of one failure: thousands of ranks that fail alike are one traceback, and a failure
that differs on every rank is told by its first few (the run's line names every rank's error)."""


def alike(tracebacks: Mapping[int, str], most: int = MOST_TRACEBACKS) -> list[tuple[tuple[int, ...], str]]:
    """The ranks of each distinct traceback (pure), the lowest rank's first; at most `most` of them."""
    ranks: dict[str, list[int]] = {}
    for rank, text in sorted(tracebacks.items()):
        ranks.setdefault(text, []).append(rank)
    return [(tuple(group), text) for text, group in ranks.items()][:most]


def worker_traceback(error: BaseException) -> str:
    """Where a worker's error was raised, as text: the traceback the worker formatted (`WorkerFailed.traceback`),
    else the one Ray Train formatted (its wrapper's text, `UserExceptionWithTraceback`), else what pickling
    left (the error's own line)."""
    told = getattr(getattr(error, "_base_exc", None) or error, "traceback", None)
    if isinstance(told, str) and told:
        return told
    text = str(error)
    return text if text.startswith("Traceback") else "".join(traceback.format_exception(error))


def deterministic_cause(error: BaseException | None) -> BaseException | None:
    """The deterministic error behind ``error``, or None: the first in its cause chain that is of a
    `DETERMINISTIC` type or marked ``deterministic = True`` (the worker marks the `WorkerFailed`
    it raises, because pickling to the controller drops the cause chain), a full disk, or a storage error
    marked ``final`` (a refusal, or one that outlasted the retry budget). Ray's wrapper of a
    worker's exception is looked through."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, DETERMINISTIC) or getattr(error, "deterministic", False) is True:
            return error
        if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:  # any write into a full disk
            return error
        # Storage that refused, or whose retry budget was spent (data/storage/retry.py): a checkpoint upload
        # (CheckpointNotWritten), a push of the run's files, a read. A restart would wait as long again.
        if isinstance(error, OSError) and getattr(error, "final", False) is True:
            return error
        seen.add(id(error))
        error = getattr(error, "_base_exc", None) or error.__cause__ or error.__context__
    return None


class StopOnDeterministicFailure(UserCallback):
    """Ends the run, without a restart, when any worker's error is deterministic (see module doc)."""

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        found = {rank: deterministic_cause(exc) for rank, exc in worker_exceptions.items()}
        lines = _lines({rank: exc for rank, exc in found.items() if exc is not None})
        if lines:
            raise DeterministicFailure("; ".join(lines) + " (not retried: a restart would fail the same way)",
                                       alike({rank: worker_traceback(exc) for rank, exc in worker_exceptions.items()}))


SHOWN_RANKS = 4
"""Ranks named before the rest of those that failed alike are counted."""


def _lines(errors: dict[int, BaseException]) -> list[str]:
    """One line per distinct error, naming the ranks that raised it: every rank of a run over its error budget
    raises the same one (`data/loader/budget.py`), said once for all of them."""
    texts = {rank: _text(rank, exc) for rank, exc in errors.items()}
    return [f"{ranks_named(group)}: {text}" for group, text in alike(texts, most=len(texts))]


def _text(rank: int, exc: BaseException) -> str:
    text, prefix = str(exc), f"rank {rank}: "
    # The worker's own WorkerFailed already reads "rank R: Type: message".
    return text.removeprefix(prefix) if text.startswith(prefix) else f"{type(exc).__name__}: {text}"


def ranks_named(ranks: list[int] | tuple[int, ...]) -> str:
    """`rank 0, rank 1, rank 2, rank 3 and 5 more ranks`: the first `SHOWN_RANKS` named, the rest counted."""
    named = ", ".join(f"rank {rank}" for rank in ranks[:SHOWN_RANKS])
    return named if len(ranks) <= SHOWN_RANKS else f"{named} and {len(ranks) - SHOWN_RANKS} more ranks"


class WorkersUnavailable(RuntimeError):
    """The cluster has had no room for the run's fewest workers for `cluster.worker_wait_s`; the message
    is the one line that says so (launch/worker_wait.py)."""


_WAITING = (InitializingState, SchedulingState, ReschedulingState, RestartingState, ResizingState)
"""Controller states with no worker group running: starting, placing one, or about to place one again."""
_PLACED = (RunningState, PreemptingState)


def cluster_room(per_worker: dict[str, float]) -> int:
    """Workers of `per_worker` resources the live nodes of the connected Ray cluster hold."""
    return workers_that_fit((node["Resources"] for node in ray.nodes() if node.get("Alive")), per_worker)


class StopWithoutRoom(ControllerCallback):
    """Ends the run when the cluster has had no room for its fewest workers for `wait_s` seconds.

    A Ray Train controller callback (a DeveloperAPI that Train V2 passes `RunConfig.callbacks` on to):
    the controller calls `after_controller_state_update` on every turn of its loop. While no worker
    group runs (starting, placing one, waiting for an elastic run's MIN), it counts the workers the live
    nodes hold (every `sample_every_s`); the decision is `worker_wait.out_of_wait`. Raising here is a
    `ControllerError` that Ray Train's failure policy never retries. A fixed run's controller blocks while
    it waits for its placement group, so the callback also shortens that wait
    (`RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`, in the controller's own process) to at most `wait_s`:
    the run stops within about `wait_s` of the shortfall's start, never forever.
    """

    def __init__(self, need: int, per_worker: dict[str, float], wait_s: float, *, elastic: bool,
                 workers_key: str = "cluster.num_workers", room: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic, sample_every_s: float = 2.0):
        self.need, self.per_worker, self.wait_s, self.elastic = need, dict(per_worker), wait_s, elastic
        self.workers_key = workers_key
        self._room = room
        self._clock = clock
        self._sample_every_s = sample_every_s
        self._seen = Shortfall()
        self._sampled_at = float("-inf")

    def after_controller_start(self, train_run_context: Any) -> None:
        # This process is the run's controller: the variable only reaches the worker groups it starts.
        current = float(os.environ.get(WORKER_GROUP_START_TIMEOUT_S_ENV_VAR, DEFAULT_WORKER_GROUP_START_TIMEOUT_S))
        os.environ[WORKER_GROUP_START_TIMEOUT_S_ENV_VAR] = f"{min(current, self.wait_s):g}"

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        now = self._clock()
        if isinstance(current_state, _PLACED):
            self._seen, self._sampled_at = observe(self._seen, now, None, self.need), float("-inf")
            return
        if not isinstance(current_state, _WAITING):  # shutting down, or ended
            return
        if now - self._sampled_at >= self._sample_every_s:  # the loop turns often; the cluster is asked less
            room = self._room() if self._room is not None else cluster_room(self.per_worker)
            self._seen, self._sampled_at = observe(self._seen, now, room, self.need), now
        if out_of_wait(self._seen, now, self.wait_s):
            raise WorkersUnavailable(no_room_line(self.need, self.per_worker, self._seen, now, elastic=self.elastic,
                                                  workers_key=self.workers_key))
