"""`cluster.worker_wait_s`: a run without room for its fewest workers stops in one line, after the wait.

The decision (`vitscale/launch/worker_wait.py`) is pure and property-tested here; the controller
callback that feeds it (`launch/failures.py::StopWithoutRoom`) is driven with Ray Train's own state
objects, a fake clock and a fake cluster. The real run is `tests/test_worker_wait_ray.py`.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vitscale.config import ConfigError
from vitscale.launch.worker_wait import Shortfall, no_room_line, observe, out_of_wait, workers_that_fit
from vitscale.stages import build_pipeline

# -- the config key -------------------------------------------------------------------------------


def _cluster(**cluster: object):
    return build_pipeline({"name": "p", "stages": ["pretrain"], "cluster": {"use_gpu": False, **cluster}}).cluster


def test_the_wait_defaults_to_ten_minutes_and_null_waits_forever() -> None:
    assert _cluster().worker_wait_s == 600.0
    assert _cluster(worker_wait_s=15).worker_wait_s == 15.0
    assert _cluster(worker_wait_s=None).worker_wait_s is None


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), "10 min", True])
def test_a_bad_wait_is_refused_naming_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"cluster\.worker_wait_s") as err:
        _cluster(worker_wait_s=bad)
    assert "\n" not in str(err.value)


# -- the decision ---------------------------------------------------------------------------------


def test_workers_fit_node_by_node_by_their_scarcest_resource() -> None:
    gpu_worker = {"CPU": 2.0, "GPU": 1.0}
    nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 3.0, "GPU": 4.0}, {"CPU": 64.0}]
    assert workers_that_fit(nodes, gpu_worker) == 2 + 1 + 0  # not (8+3+64)//2 nor (2+4)//1
    assert workers_that_fit([{"CPU": 2.0}], {"CPU": 1.0}) == 2
    assert workers_that_fit([{"CPU": 0.9999999999}], {"CPU": 1 / 3}) == 3  # float sums that miss by a hair
    assert workers_that_fit([], {"CPU": 1.0}) == 0


# (time step, room: None = the workers are placed and running)
events = st.lists(st.tuples(st.floats(0, 100), st.one_of(st.none(), st.integers(0, 8))), max_size=40)


@given(events, st.integers(1, 8), st.floats(1, 500))
def test_the_run_stops_exactly_when_it_has_gone_the_wait_without_room(steps, need: int, wait_s: float) -> None:
    seen, now, short_since = Shortfall(), 0.0, None
    for step, room in steps:
        now += step
        seen = observe(seen, now, room, need)
        # the reference: the start of the latest unbroken stretch of observations short of room
        short = room is not None and room < need
        short_since = (short_since if short_since is not None else now) if short else None
        assert seen.since == short_since
        assert out_of_wait(seen, now, wait_s) == (short_since is not None and now - short_since >= wait_s)
        assert not out_of_wait(seen, now, None)  # null: never
        if short:
            assert seen.most < need  # the line never claims room it did not lack


@given(st.integers(1, 64), st.floats(0.5, 10_000))
def test_workers_slow_to_start_within_the_wait_still_run(need: int, wait_s: float) -> None:
    """Nodes coming up one by one: short of room until just before the wait, then the workers start."""
    seen = Shortfall()
    for i in range(need):
        now = wait_s * 0.99 * i / need
        seen = observe(seen, now, i, need)
        assert not out_of_wait(seen, now, wait_s)
    seen = observe(seen, wait_s * 0.995, need, need)  # room for all of them: the workers are placed
    assert seen == Shortfall() and not out_of_wait(seen, wait_s * 10, wait_s)


def test_the_line_says_why_and_what_to_change() -> None:
    seen = observe(observe(Shortfall(), 100.0, 2, 4), 400.0, 1, 4)
    line = no_room_line(4, {"CPU": 2.0, "GPU": 1.0}, seen, 700.0, elastic=True)
    assert line == ("4 workers of {CPU: 2, GPU: 1} needed (cluster.num_workers min 4), but the cluster has had room "
                    "for at most 2 for 600 s; add nodes, lower cluster.num_workers, or raise cluster.worker_wait_s")
    fixed = no_room_line(3, {"CPU": 1.0}, seen, 700.0, elastic=False, workers_key="sweep.workers_per_trial")
    assert "(sweep.workers_per_trial 3)" in fixed and "lower sweep.workers_per_trial" in fixed


# -- the controller callback, with Ray Train's states --------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _states():
    pytest.importorskip("ray")
    from ray.train.v2._internal.execution.controller import state

    return state


def test_the_callback_stops_a_run_short_of_room_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.launch.failures import StopWithoutRoom, WorkersUnavailable

    s = _states()
    clock, rooms = Clock(), []

    def room() -> int:
        rooms.append(clock.now)
        return 2

    monkeypatch.delenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", raising=False)
    stop = StopWithoutRoom(3, {"CPU": 1.0}, 15.0, elastic=False, room=room, clock=clock)
    stop.after_controller_start(None)
    # a fixed run's controller blocks on its placement group for Ray's start timeout: no longer than the wait
    assert os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "15"
    initializing = s.InitializingState()
    stop.after_controller_state_update(initializing, initializing)
    clock.now = 1.0  # the loop turns often; the cluster is asked every 2 s
    stop.after_controller_state_update(initializing, initializing)
    assert rooms == [0.0]
    clock.now = 14.9
    stop.after_controller_state_update(initializing, s.ReschedulingState(training_failed_error=None))
    clock.now = 15.0
    with pytest.raises(WorkersUnavailable, match=r"3 workers of \{CPU: 1\} needed \(cluster\.num_workers 3\), "
                       r"but the cluster has had room for at most 2 for 15 s; .*raise cluster\.worker_wait_s"):
        stop.after_controller_state_update(initializing, s.ReschedulingState(training_failed_error=None))


def test_the_callback_keeps_waiting_while_workers_run_or_the_cluster_has_room(monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.launch.failures import StopWithoutRoom

    s = _states()
    clock, room = Clock(), [1]
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "5")
    stop = StopWithoutRoom(2, {"CPU": 1.0}, 15.0, elastic=True, room=lambda: room[0], clock=clock)
    stop.after_controller_start(None)
    assert os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "5"  # never lengthened
    restarting = s.RestartingState(training_failed_error=None)
    for t in range(0, 14):  # nodes still coming up
        clock.now = float(t)
        stop.after_controller_state_update(restarting, restarting)
    clock.now, room[0] = 14.0, 2  # the second node joined: room for MIN
    stop.after_controller_state_update(restarting, s.SchedulingState(scaling_decision=None))
    clock.now = 20.0
    stop.after_controller_state_update(restarting, s.RunningState())
    clock.now, room[0] = 21.0, 0  # a node lost mid-run: the clock starts again from here
    stop.after_controller_state_update(s.RunningState(), restarting)
    clock.now = 35.9
    stop.after_controller_state_update(restarting, restarting)  # 14.9 s short: not yet
    clock.now = 1e6  # shutting down or ended: nothing to decide
    stop.after_controller_state_update(restarting, s.FinishedState())
