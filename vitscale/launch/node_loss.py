"""After a lost node, restart an elastic run at the size the live cluster holds, within seconds of Ray knowing.

Ray Train V2 (2.60) decides an elastic run's size from the resources the AutoscalingCoordinator reserved
for it, a view the coordinator refreshes from the GCS's node table every 20 s. Right after a node dies,
that view still holds the dead node: the restart tried a group of MAX, and its placement group waited out
`RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S` (60 s) before Ray Train decided again and started the workers
left (77 s from a SIGKILLed node to the next step on a 2-node local Ray, `tests/test_elastic_ray.py`).

Two seconds-scale facts set what a restart can do. The surviving ranks fail within ~3 s of the loss (a
collective with a dead peer, a health check that finds no worker), but the GCS declares a SIGKILLed node
dead only after its health checks fail (Ray's defaults: 5 checks 3 s apart, ~14 s): until then every view
of the cluster, `ray.nodes()` included, still counts the dead node, so the first decision after the loss
can be MAX whatever it asks. So `RestartAtLiveSize`, for an elastic run, while it recovers from a worker
group's failure:

- refreshes the coordinator's view from the GCS's node table (`get_reserved_resources(recompute=True)`,
  the coordinator's own on-demand tick) each time the controller is about to decide a size again, so the
  decision counts exactly the nodes the GCS holds alive at that moment, not those of up to 20 s before;
- lets a placement wait at most `RESTART_PLACEMENT_WAIT_S` (the start timeout, in this controller's
  process, for the recovery's starts only): a group placed from a view that still held the dead node is
  given up within seconds, and the next decision, on a refreshed view, is the size the live nodes hold.

Why a controller callback: Train V2 builds its scaling policy itself (`create_scaling_policy`, with no
parameter to pass one), while `RunConfig.callbacks` is where it takes `ControllerCallback`s (a DeveloperAPI)
and calls `after_controller_state_update` on every transition, before the next decision. The refresh is
the coordinator's own recompute, so Ray's policy makes the decision and logs it; no decision of Ray's is
overridden. The first start and a growth keep the configured start timeout: they place groups on nodes
the view has just seen join, and an autoscaler may need the minute.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from ray.train.v2._internal.constants import WORKER_GROUP_START_TIMEOUT_S_ENV_VAR
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.controller.state import ReschedulingState, RestartingState, RunningState

logger = logging.getLogger(__name__)

RESTART_PLACEMENT_WAIT_S = 10.0
"""The longest a recovering run's placement group may wait before Ray Train decides its size again. A
placement on live free nodes takes well under a second; a longer wait means the view held a node that is
gone. Short enough that the retry follows the GCS's verdict on a dead node (~14 s) by seconds."""

REFRESH_TIMEOUT_S = 5.0
"""How long to wait for the coordinator's refresh (Ray Train waits as long for its own calls to it)."""


def refresh_reserved_resources(requester_id: str | None) -> None:
    """Make the AutoscalingCoordinator recompute every requester's reserved resources from the GCS's node
    table now, instead of at its next 20 s tick. A failure is logged: the tick still comes."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    try:
        coordinator = get_or_create_autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote(requester_id or "", recompute=True),
                timeout=REFRESH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 -- a stale view costs seconds; failing the run would cost it all
        logger.warning("could not refresh the cluster's resource view (%s: %s); the next decision may count "
                       "a lost node until the coordinator's own refresh", type(exc).__name__, exc)


class RestartAtLiveSize(ControllerCallback):
    """Recovering from a worker group's failure, an elastic run restarts at the size the live nodes hold
    (see module doc): the resource view refreshed before each decision, each placement bounded by
    `restart_wait_s`. `refresh` is injectable for tests."""

    def __init__(self, restart_wait_s: float = RESTART_PLACEMENT_WAIT_S,
                 refresh: Callable[[str | None], None] = refresh_reserved_resources):
        self.restart_wait_s = restart_wait_s
        self._refresh = refresh
        self._requester_id: str | None = None
        self._recovering = False
        self._configured: str | None = None  # the start timeout to put back once a group runs

    def after_controller_start(self, train_run_context: Any) -> None:
        # The scaling policy's name for this run at the coordinator (ScalingPolicy.after_controller_start).
        self._requester_id = f"train-{train_run_context.run_id}"

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        if isinstance(current_state, (RestartingState, ReschedulingState)):  # a size is decided next
            if not self._recovering:
                self._recovering = True
                self._configured = os.environ.get(WORKER_GROUP_START_TIMEOUT_S_ENV_VAR)
                # Read by each WorkerGroup Ray Train creates in this process: the recovery's placements only.
                os.environ[WORKER_GROUP_START_TIMEOUT_S_ENV_VAR] = f"{self._recovery_wait_s():g}"
            self._refresh(self._requester_id)
        elif isinstance(current_state, RunningState) and self._recovering:  # a group is placed and started
            self._recovering = False
            if self._configured is None:
                os.environ.pop(WORKER_GROUP_START_TIMEOUT_S_ENV_VAR, None)
            else:
                os.environ[WORKER_GROUP_START_TIMEOUT_S_ENV_VAR] = self._configured

    def _recovery_wait_s(self) -> float:
        """The recovery's placement wait: `restart_wait_s`, never longer than the configured start timeout
        (`cluster.worker_wait_s` may have shortened it: launch/failures.py)."""
        configured = self._configured
        try:
            return min(self.restart_wait_s, float(configured)) if configured is not None else self.restart_wait_s
        except ValueError:
            return self.restart_wait_s
