"""A stop asked of a running Train run by its driver: the workers checkpoint at their next step, then end.

Ctrl-C, SIGTERM (`ray job stop`, `kill`, a scheduler) or SIGHUP to `vitscale run` used to abort the run's
controller at once: the workers died wherever they were, and a resume redid every step since the last
periodic checkpoint (up to `train.checkpoint_every`). Now the driver's first signal asks instead
(`launch/interruption.py`), through a small actor the driver owns: rank 0 reads it every
:data:`POLL_S` (a call the step never waits for, not a barrier), its vote rides in the step's all-reduce
(`train/stopvote.py`), and every rank checkpoints at the same step and returns. The run ends as finished,
the driver then ends in the CLI's line saying how to resume; the resume starts at the very next step.

A run whose workers have not made a step yet (starting, waiting for room, restoring) is aborted at once:
no step is lost. So is one whose driver runs as a Ray job on a head that leaves it too little time
(`stop_grace`: `ray job stop` SIGKILLs the driver `RAY_JOB_STOP_WAIT_TIME_S` after its SIGTERM, 3 s by
default; vitscale's manifests set 150). One that cannot honour the stop soon (a step that hangs, workers
restarting) is aborted after the run's `cluster.preemption_grace_s`, or at once on a second signal.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import ray

__all__ = ["POLL_S", "StopPoll", "StopRequests", "stop_grace", "stop_requests"]

POLL_S = 1.0
"""How often rank 0 reads the driver's stop request: a call to an actor, about a millisecond."""

RAY_JOB_STOP_WAIT_S = 3.0
"""Ray's default `RAY_JOB_STOP_WAIT_TIME_S`: `ray job stop` SIGKILLs a job's driver this long after its SIGTERM."""

ENDING_S = 10.0
"""What a driver needs after its workers stopped: the abort's answer, the lease released, the run's files pushed."""


def stop_grace(configured: float, environ: Mapping[str, str]) -> float:
    """How long the driver may wait for its workers' stop: `cluster.preemption_grace_s`, or less where it runs
    as a Ray job, whose driver `ray job stop` SIGKILLs `RAY_JOB_STOP_WAIT_TIME_S` after the signal (3 s unless
    the head says otherwise): the driver must still end in its own line. 0: abort at once."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in environ:  # set by Ray's job supervisor for a job's driver
        return configured
    try:
        wait = float(environ.get("RAY_JOB_STOP_WAIT_TIME_S", RAY_JOB_STOP_WAIT_S))
    except ValueError:
        wait = RAY_JOB_STOP_WAIT_S
    return max(0.0, min(configured, wait - ENDING_S))


class StopRequests:
    """The driver's stop requests to its Train runs (keyed by a run's storage location); served by an actor."""

    def __init__(self) -> None:
        self.asked: dict[str, str] = {}
        self.read: set[str] = set()  # runs whose rank 0 has read its request: their workers are stepping

    def ask(self, run: str, why: str) -> bool:
        """Ask `run` to stop; whether its workers are stepping (else there is no step to wait for)."""
        self.asked.setdefault(run, why)
        return run in self.read

    def why(self, run: str) -> str | None:
        self.read.add(run)
        return self.asked.get(run)


def stop_requests() -> Any:
    """A new `StopRequests` actor for a run, owned by this driver: it dies with the driver, or once the run's
    trainer and workers let go of it. Never kept across runs: a handle from an earlier `ray.init` is dead, and
    putting it into a run's config aborted the whole process (Ray's own check)."""
    return ray.remote(num_cpus=0)(StopRequests).remote()


class StopPoll:
    """A worker's reading of the driver's stop request for its run, at most every :data:`POLL_S`, never waited
    for: it is called inside the step (`train/stopvote.py`), where waiting on the driver's actor (a round trip,
    up to seconds when the driver's node is busy) would hold the step. Each call asks, or takes the answer
    to the last question if it has come; a request is therefore seen a call or two after it was made."""

    def __init__(self, requests: Any, run: str) -> None:
        self.requests, self.run = requests, run
        self.last = float("-inf")
        self.pending: Any = None  # the question in flight (an object ref), if any

    def __call__(self) -> str | None:
        if self.pending is not None:
            ready, _ = ray.wait([self.pending], timeout=0)
            if not ready:
                return None
            answer, self.pending = self.pending, None
            try:
                return ray.get(answer, timeout=0)
            except Exception:  # noqa: BLE001 -- the driver gone (its own ending stops the run): never a failed step
                return None
        now = time.monotonic()
        if now - self.last >= POLL_S:
            self.last = now
            try:
                self.pending = self.requests.why.remote(self.run)
            except Exception:  # noqa: BLE001 -- as above: no question asked, the next poll tries again
                self.pending = None
        return None
