"""Deterministic worker failures end a run at once; others are left to Ray's restarts."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

from vitscale.config.checks import ConfigError
from vitscale.data.format import DatasetError
from vitscale.data.loader.stream import ErrorBudgetExceeded
from vitscale.launch.failures import DeterministicFailure, StopOnDeterministicFailure, deterministic_cause
from vitscale.launch.ray_train import _root_cause
from vitscale.launch.train_worker import WorkerFailed
from vitscale.train.checkpoint import DiskFull
from vitscale.train.engine import UnsafeCheckpoint
from vitscale.train.loop import NonFiniteSteps
from vitscale.train.worker import StreamMismatch


def _as_controller_sees_it(rank: int, exc: BaseException) -> BaseException:
    """What `train_worker` raises for `exc`, after the trip to Ray's controller (pickled, wrapped)."""
    failure = WorkerFailed(f"rank {rank}: {type(exc).__name__}: {exc}")
    failure.deterministic = deterministic_cause(exc) is not None
    failure.traceback = f"Traceback (most recent call last):\n  File \"loop.py\", line {rank}\n{type(exc).__name__}"
    failure.__cause__ = exc
    shipped = pickle.loads(pickle.dumps(failure))  # the cause chain does not survive this
    assert shipped.__cause__ is None
    return UserExceptionWithTraceback(shipped, traceback_str="Traceback ...")


def _refused_by_pydantic() -> Exception:
    """What DeepSpeed raises building an engine from a section its config model refuses."""
    import pydantic

    class Section(pydantic.BaseModel, extra="forbid"):
        overlap_comm: bool = False

    try:
        Section(overlap_com=True)
    except pydantic.ValidationError as error:
        return error
    raise AssertionError("pydantic took an unknown field")


@pytest.mark.parametrize("exc", [
    ErrorBudgetExceeded("12 samples skipped in epoch 0, over the error budget; bad shards: train-000003.tar (12)"),
    DatasetError("1 shard(s) of split 'train' missing"),
    ConfigError("data.url", "must name a folder"),
    ConfigError("train.base_lr", "changed since the checkpoint: 0.001 -> 0.002; resuming would mix two runs"),
    NonFiniteSteps("11 steps with a non-finite loss or gradients (first at step 40), over train.max_skipped_steps"),
    UnsafeCheckpoint("checkpoint_000010/rank0.pt: refusing to unpickle builtins.exec"),
    DiskFull("no space for the checkpoint at /runs/r/checkpoint_000000008: 1.0 MiB free, 3.0 MiB needed"),
    # An older checkpoint (no dataset record) resumed on a dataset of another size: retried max_failures times.
    StreamMismatch("checkpoint_000000005: rank 1's saved stream position {'epoch': 1, 'position': 0} is not "
                   "the one step 5 implies ({'epoch': 0, 'position': 40})"),
    _refused_by_pydantic(),
])  # fmt: skip
def test_deterministic_failures_stop_the_run(exc):
    callback = StopOnDeterministicFailure()
    with pytest.raises(DeterministicFailure) as stopped:
        callback.after_exception(None, {0: _as_controller_sees_it(0, RuntimeError("peer gone")),
                                        1: _as_controller_sees_it(1, exc)})
    message = str(stopped.value)
    assert message.startswith(f"rank 1: {type(exc).__name__}: ") and "not retried" in message
    assert "rank 0" not in message  # the collateral failure of the other rank is not the cause


def test_other_failures_are_left_to_restarts():
    callback = StopOnDeterministicFailure()
    for exc in (RuntimeError("NCCL timeout"), MemoryError(), OSError("connection reset")):
        callback.after_exception(None, {0: _as_controller_sees_it(0, exc)})  # no exception: Ray retries


def test_a_cause_deep_in_the_chain_counts():
    try:
        try:
            raise ErrorBudgetExceeded("over")
        except ErrorBudgetExceeded as inner:
            raise RuntimeError("while training") from inner
    except RuntimeError as outer:
        assert isinstance(deterministic_cause(outer), ErrorBudgetExceeded)
    assert deterministic_cause(ValueError("plain")) is None


def test_the_cli_line_is_the_workers_own():
    from ray.train.v2.api.exceptions import ControllerError

    stopped = DeterministicFailure("rank 1: ErrorBudgetExceeded: over (not retried: a restart would fail the same way)")
    assert _root_cause(ControllerError(stopped)) == str(stopped)


def test_ranks_that_fail_alike_are_said_once():
    """Every rank of a run over its error budget raises the same error: one line names them all; a different
    error on another rank keeps its own line, and many ranks are counted, not listed."""
    same = ErrorBudgetExceeded("5 samples skipped in epoch 0 (all 8 ranks); bad shards: train-000003.tar (5 on rank 2)")
    other = ConfigError("data.url", "must name a folder")
    callback = StopOnDeterministicFailure()
    with pytest.raises(DeterministicFailure) as stopped:
        callback.after_exception(None, {r: _as_controller_sees_it(r, same if r != 6 else other) for r in range(8)})
    assert str(stopped.value) == (f"rank 0, rank 1, rank 2, rank 3 and 3 more ranks: ErrorBudgetExceeded: {same}; "
                                  f"rank 6: ConfigError: {other} (not retried: a restart would fail the same way)")
    with pytest.raises(DeterministicFailure, match=r"^rank 0, rank 1: ErrorBudgetExceeded: 5 samples"):
        callback.after_exception(None, {r: _as_controller_sees_it(r, same) for r in (1, 0)})


def test_each_failed_ranks_traceback_reaches_the_run_log_whichever_way_the_run_ended(tmp_path, monkeypatch):
    """Ray's forwarding of a rank's own lines can lose the race with the driver's exit: the tracebacks travel
    in what Ray Train returns instead, the error that stopped the run or the workers' errors after its restarts,
    and the driver writes them into the run's log (not the terminal), ranks that failed alike once."""
    import io
    import sys

    from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

    from vitscale.launch.console import TerminalFilter
    from vitscale.launch.ray_train import log_tracebacks

    budget, gone = ErrorBudgetExceeded("over"), RuntimeError("peer gone")
    with pytest.raises(DeterministicFailure) as stopped:
        StopOnDeterministicFailure().after_exception(None, {0: _as_controller_sees_it(0, gone),
                                                            1: _as_controller_sees_it(1, budget)})
    shipped = pickle.loads(pickle.dumps(ControllerError(stopped.value)))  # the controller's trip to the driver
    restarts_spent = WorkerGroupError("workers failed", {3: _as_controller_sees_it(3, gone)})
    for error, ranks in ((shipped, (0, 1)), (restarts_spent, (3,))):
        terminal, log = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stderr", TerminalFilter(terminal, log))
        log_tracebacks(error, "pre-training")
        told = log.getvalue()
        assert terminal.getvalue() == ""
        for rank in ranks:
            assert (f"[vitscale] pre-training: the traceback of rank {rank}, as Ray Train returned it to the driver:\n"
                    f'Traceback (most recent call last):\n  File "loop.py", line {rank}\n') in told, told
        assert told.count("Traceback") == len(ranks)


def test_thousands_of_ranks_that_fail_alike_carry_one_traceback() -> None:
    """The error that stops a run travels to the driver pickled: 2,048 ranks over one error budget send one
    traceback, not 2,048; a failure that differs on every rank keeps its first few."""
    from vitscale.launch.failures import MOST_TRACEBACKS

    budget = ErrorBudgetExceeded("5 samples skipped in epoch 0 (all 2048 ranks)")
    shipped = {rank: _as_controller_sees_it(rank, budget) for rank in range(2048)}
    for failure in shipped.values():
        failure._base_exc.traceback = "Traceback (most recent call last):\nErrorBudgetExceeded: over\n"
    with pytest.raises(DeterministicFailure) as stopped:
        StopOnDeterministicFailure().after_exception(None, shipped)
    assert stopped.value.tracebacks == [(tuple(range(2048)), "Traceback (most recent call last):\nErrorBudgetExceeded: "
                                                             "over\n")]
    with pytest.raises(DeterministicFailure) as stopped:
        StopOnDeterministicFailure().after_exception(None, {r: _as_controller_sees_it(r, budget) for r in range(64)})
    assert [ranks for ranks, _ in stopped.value.tracebacks] == [(r,) for r in range(MOST_TRACEBACKS)]


@given(st.dictionaries(st.integers(0, 4095), st.sampled_from(["a", "b", "c", "d"]), max_size=64),
       st.integers(1, 5))
def test_alike_groups_each_rank_once_under_its_own_traceback(tracebacks: dict[int, str], most: int) -> None:
    from vitscale.launch.failures import alike

    groups = alike(tracebacks, most=most)
    assert len(groups) == min(most, len(set(tracebacks.values())))
    assert len({text for _, text in groups}) == len(groups)  # each traceback once
    for ranks, text in groups:
        assert list(ranks) == sorted(ranks) and all(tracebacks[r] == text for r in ranks)
        assert set(ranks) == {r for r, t in tracebacks.items() if t == text}  # every rank of a kept traceback
    firsts = [ranks[0] for ranks, _ in groups]
    assert firsts == sorted(firsts) and (not groups or firsts[0] == min(tracebacks))


def test_a_log_that_cannot_take_the_tracebacks_never_hides_the_runs_own_error(tmp_path, monkeypatch, capsys):
    """The run's log is closed (or its disk full, or its writer broken): the run still ends in its own line."""
    import io
    import sys

    from ray.train.v2.api.exceptions import ControllerError

    from vitscale.config.pipeline import ClusterConfig
    from vitscale.launch import ray_train
    from vitscale.launch.console import TerminalFilter
    from vitscale.launch.errors import PipelineFailed
    from vitscale.launch.run_place import RunPlace

    stopped = DeterministicFailure("rank 0: ErrorBudgetExceeded: over (not retried: a restart would fail the same "
                                   "way)", [((0,), "Traceback (most recent call last):\nErrorBudgetExceeded: over\n")])

    class Stopped:  # what Ray Train's `fit` raises for a run its controller stopped
        def fit(self) -> None:
            raise ControllerError(stopped)

    broken = io.StringIO()
    broken.close()  # every write raises ValueError
    monkeypatch.setattr(sys, "stderr", TerminalFilter(io.StringIO(), broken))
    monkeypatch.setattr(ray_train, "trainer_for", lambda *args, **kwargs: Stopped())
    with pytest.raises(PipelineFailed, match=r"^pre-training failed: rank 0: ErrorBudgetExceeded: over"):
        ray_train.launch_training(None, ClusterConfig(), RunPlace(str(tmp_path / "run"), None), what="pre-training")
    assert "the failed ranks' tracebacks could not be written to the run's log: ValueError" in capsys.readouterr().out
