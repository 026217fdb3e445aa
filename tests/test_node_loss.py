"""An elastic run's recovery from a lost node (`vitscale/launch/node_loss.py`), driven with Ray Train's own
controller states and a fake refresh. The timing on a real multi-node Ray is `tests/test_elastic_ray.py`."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

VAR = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


def _states():
    pytest.importorskip("ray")
    from ray.train.v2._internal.execution.controller import state

    return state


def test_a_recovery_refreshes_the_view_before_each_decision_and_bounds_each_placement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.launch.node_loss import RestartAtLiveSize

    s = _states()
    monkeypatch.delenv(VAR, raising=False)
    refreshed: list[str | None] = []
    callback = RestartAtLiveSize(restart_wait_s=10.0, refresh=refreshed.append)
    callback.after_controller_start(SimpleNamespace(run_id="abc"))
    running, scheduling = s.RunningState(), s.SchedulingState(scaling_decision=None)

    # The first start: Ray Train's own timeout, no refresh.
    callback.after_controller_state_update(s.InitializingState(), scheduling)
    callback.after_controller_state_update(scheduling, running)
    assert VAR not in os.environ and refreshed == []

    # Workers failed (a node lost): the view is refreshed before the size is decided again ...
    failed = s.RestartingState(training_failed_error=None)
    callback.after_controller_state_update(running, failed)
    assert refreshed == ["train-abc"] and os.environ[VAR] == "10"
    # ... a placement from a view that still held the dead node gives up within 10 s, and is decided again
    callback.after_controller_state_update(failed, scheduling)
    again = s.ReschedulingState(training_failed_error=None)
    callback.after_controller_state_update(scheduling, again)
    assert refreshed == ["train-abc", "train-abc"] and os.environ[VAR] == "10"
    # ... until a group runs: the configured timeout is back (here: none, Ray Train's default).
    callback.after_controller_state_update(again, scheduling)
    callback.after_controller_state_update(scheduling, running)
    assert VAR not in os.environ

    # Growing to more workers keeps the configured timeout: the nodes have just joined.
    callback.after_controller_state_update(running, s.ResizingState(scaling_decision=None))
    callback.after_controller_state_update(s.ResizingState(scaling_decision=None), scheduling)
    assert VAR not in os.environ and len(refreshed) == 2


@pytest.mark.parametrize("configured, during", [("60", "10"), ("5", "5"), ("oops", "10")])
def test_the_recovery_wait_never_lengthens_a_configured_timeout(monkeypatch: pytest.MonkeyPatch, configured: str,
                                                                during: str) -> None:
    from vitscale.launch.node_loss import RestartAtLiveSize

    s = _states()
    monkeypatch.setenv(VAR, configured)  # e.g. shortened to cluster.worker_wait_s (launch/failures.py)
    callback = RestartAtLiveSize(restart_wait_s=10.0, refresh=lambda _: None)
    callback.after_controller_state_update(s.RunningState(), s.RestartingState(training_failed_error=None))
    assert os.environ[VAR] == during
    callback.after_controller_state_update(s.SchedulingState(scaling_decision=None), s.RunningState())
    assert os.environ[VAR] == configured


def test_only_an_elastic_run_gets_the_callback() -> None:
    from vitscale.launch.node_loss import RestartAtLiveSize
    from vitscale.launch.ray_train import _room_callbacks
    from vitscale.stages import build_pipeline

    def cluster(workers: object):
        return build_pipeline({"name": "p", "stages": ["pretrain"],
                               "cluster": {"use_gpu": False, "num_workers": workers}}).cluster

    def kinds(workers: object) -> list[type]:
        return [type(c) for c in _room_callbacks(cluster(workers), {"CPU": 1.0}, "cluster.num_workers")]

    assert RestartAtLiveSize in kinds([2, 4])
    assert RestartAtLiveSize not in kinds(4)
