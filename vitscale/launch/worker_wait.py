"""How long a run may go without room for its fewest workers: the decision and its one line, pure.

Ray Train V2 (2.60) waits forever when the cluster cannot hold MIN workers. A fixed run waits for its
placement group `RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S` (60 s), gets `WorkerGroupStartupTimeoutError`,
which its failure policy counts as a controller failure (`FailureConfig.controller_failure_limit`,
-1: unlimited; not `max_failures`) and retries, again and again. An elastic run's scaling policy
answers "no decision" while the reserved resources hold fewer than MIN workers, so its controller
stays in INITIALIZING (or RESTARTING after nodes were lost), logging every 30 s. `cluster.worker_wait_s`
bounds that wait: the controller callback in `launch/failures.py` (`StopWithoutRoom`) feeds these
functions what it sees and ends the run with `no_room_line` once they say so.

"Room" is what the cluster's live nodes could hold, whatever else runs on them: a run queued behind
other runs (sweep trials, another job) that hold resources the cluster has is not short of room and
waits on, as Ray Train does; a run whose nodes are gone, or never came, is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def workers_that_fit(nodes: Iterable[Mapping[str, float]], per_worker: Mapping[str, float]) -> int:
    """How many workers of `per_worker` resources the `nodes` (each node's total resources) hold: a
    worker lives on one node, so each node holds as many as its scarcest resource allows."""
    needed = {name: amount for name, amount in per_worker.items() if amount > 0}
    if not needed:
        return 2**31 - 1  # a worker that needs nothing fits anywhere
    return sum(min(math.floor(node.get(name, 0.0) / amount + 1e-9) for name, amount in needed.items())
               for node in nodes)


@dataclass(frozen=True)
class Shortfall:
    """What a run has seen of the cluster since it last had its workers running, or room for them."""

    since: float | None = None
    """When the run began to lack room for its fewest workers (a monotonic time); None: it does not."""
    most: int = 0
    """The most workers the cluster had room for since then."""


def observe(seen: Shortfall, now: float, room: int | None, need: int) -> Shortfall:
    """`seen` updated with what the cluster holds at `now`: `room` workers, or None when the run's
    workers are placed and running. Room for `need` (MIN) workers, or workers running, clears it."""
    if room is None or room >= need:
        return Shortfall()
    if seen.since is None:
        return Shortfall(since=now, most=room)
    return Shortfall(since=seen.since, most=max(seen.most, room))


def out_of_wait(seen: Shortfall, now: float, wait_s: float | None) -> bool:
    """The run has gone `wait_s` seconds or more without room for its fewest workers (never when
    `wait_s` is None: wait forever)."""
    return wait_s is not None and seen.since is not None and now - seen.since >= wait_s


def no_room_line(need: int, per_worker: Mapping[str, float], seen: Shortfall, now: float, *, elastic: bool,
                 workers_key: str = "cluster.num_workers", wait_key: str = "cluster.worker_wait_s") -> str:
    """The one line a run stopped for want of room ends with: what it needs, what the cluster had, for
    how long, and what to change."""
    resources = ", ".join(f"{name}: {amount:g}" for name, amount in per_worker.items())
    size = f"{workers_key} min {need}" if elastic else f"{workers_key} {need}"
    waited = 0.0 if seen.since is None else now - seen.since
    return (f"{need} workers of {{{resources}}} needed ({size}), but the cluster has had room for at most "
            f"{seen.most} for {waited:.0f} s; add nodes, lower {workers_key}, or raise {wait_key}")
