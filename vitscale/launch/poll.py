"""How often Ray Train's controller polls its workers, set for the run's size.

The controller takes the workers' reports (a checkpoint's, an evaluation's) at its polls, one at a time: a
report waits for the poll after the previous one, and the end of a run or a worker's failure is seen at the
next poll. Ray's default (2 s, `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`) is made for any size; a poll asks every
worker once, so a small run can be polled far more often at the same cost. vitscale keeps to about
`ASKS_PER_S` asks a second: every 0.25 s up to 16 workers, 2 s (Ray's own) from 128. A tiny CPU run ended 5 s
sooner (of about 21) at 0.25 s. A value the user set in the environment is left as it is.
"""

from __future__ import annotations

import os

POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
ASKS_PER_S = 64
FASTEST_S, RAYS_S = 0.25, 2.0

_USERS = os.environ.get(POLL_ENV)  # read once: later values in this process are vitscale's own


def poll_interval_s(workers: int) -> float:
    """Seconds between the controller's polls of `workers` workers (pure): ASKS_PER_S at most, within
    [FASTEST_S, RAYS_S]."""
    return min(RAYS_S, max(FASTEST_S, workers / ASKS_PER_S))


def set_controller_poll(workers: int) -> None:
    """Put the interval for `workers` where Ray Train hands it to the controller it starts next (the
    driver's environment), unless the user chose one."""
    if _USERS is None:
        os.environ[POLL_ENV] = f"{poll_interval_s(workers):g}"
