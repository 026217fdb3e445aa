"""The stop vote's reading of the summed votes (train/stopvote.py): every rank, told or not, acts at one step."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from vitscale.train.context import WorkerContext
from vitscale.train.stopvote import StopVote

STREAM = SimpleNamespace(epoch_skipped=lambda: 2, skipped=lambda: {"train-000001.tar": 2})


def _vote(rank: int, asked: str | None = None, told: str | None = None) -> StopVote:
    return StopVote(WorkerContext(rank=rank, world_size=2, run_dir=Path("."), stop_requested=lambda: asked,
                                  terminated=lambda: told, preemption_every_s=3600))


def test_only_rank_0_reads_the_drivers_stop_request_and_every_rank_ends_with_it() -> None:
    asked = "the run was asked to stop (SIGINT to the driver)"
    zero, one = _vote(0, asked=asked), _vote(1, asked="never read")
    votes = [zero.votes(STREAM), one.votes(STREAM)]
    assert votes == [[0.0, 0.0, 2.0, 1.0], [0.0, 0.0, 2.0, 0.0]]
    summed = tuple(a + b for a, b in zip(*votes))
    for vote in (zero, one):
        notice = vote.decide(summed, step=7)
        assert notice is not None and notice.ending and not notice.stopping and not notice.told
    assert zero.decide(summed, 7).text == asked and one.decide(summed, 7).text == "the driver asked the run to stop"


def test_a_sigterm_to_a_worker_outranks_the_drivers_stop() -> None:
    told, asked = _vote(1, told="rank 1 received SIGTERM"), _vote(0, asked="the run was asked to stop")
    summed = tuple(a + b for a, b in zip(asked.votes(STREAM), told.votes(STREAM)))
    notice = told.decide(summed, step=3)
    assert notice is not None and notice.stopping == 1 and notice.told and notice.text == "rank 1 received SIGTERM"


def test_no_request_no_notice() -> None:
    vote = _vote(0)
    assert vote.decide(tuple(vote.votes(STREAM)), step=1) is None


def test_a_request_says_whether_the_runs_workers_are_stepping() -> None:
    """A run whose rank 0 has never read its request has no step to wait for: the driver aborts it at once."""
    from vitscale.launch.stop_request import StopRequests

    requests = StopRequests()
    assert requests.why("s3://b/runs/a") is None  # rank 0 of run a reads, every step
    assert requests.ask("s3://b/runs/b", "asked (SIGINT)") is False  # run b: no worker has stepped yet
    assert requests.ask("s3://b/runs/a", "asked (SIGTERM)") is True
    assert requests.ask("s3://b/runs/a", "asked again") is True
    assert requests.why("s3://b/runs/a") == "asked (SIGTERM)" and requests.why("s3://b/runs/c") is None


def test_a_ray_jobs_driver_waits_only_as_long_as_ray_job_stop_lets_it() -> None:
    from vitscale.launch.stop_request import ENDING_S, stop_grace

    job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    assert stop_grace(120, {}) == 120  # a terminal's Ctrl-C, `kill`: the run's own grace
    assert stop_grace(120, job) == 0  # Ray's 3 s: abort at once, the driver's line still said
    assert stop_grace(120, {**job, "RAY_JOB_STOP_WAIT_TIME_S": "150"}) == 120
    assert stop_grace(120, {**job, "RAY_JOB_STOP_WAIT_TIME_S": "60"}) == 60 - ENDING_S
    assert stop_grace(120, {**job, "RAY_JOB_STOP_WAIT_TIME_S": "soon"}) == 0
