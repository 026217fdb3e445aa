"""A resumed trial's wall time adds the attempts that died before the one that finished; the final reports a
resumed sweep replays are the ones its trials saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vitscale.data.storage import open_storage
from vitscale.stages.sweep_results import FINAL_REPORT, earlier_attempts_s, finished_trials, save_final_report


def _attempt(start: float, seconds: list[float]) -> list[dict[str, float]]:
    return [{"time_total_s": s, "timestamp": start + s} for s in seconds]


def test_a_killed_attempt_counts_and_the_last_does_not() -> None:
    reports = _attempt(1000, [5, 10, 42]) + _attempt(2000, [3, 8])
    assert earlier_attempts_s(reports, started_at=2000) == 42


def test_a_replayed_final_report_is_not_counted_twice() -> None:
    # The trial finished (started 1000, finished 1050) before the driver died; the restarted trial
    # reported the same final result again at once.
    reports = [*_attempt(1000, [20, 50]), {"time_total_s": 0.1, "timestamp": 3000}]
    assert earlier_attempts_s(reports, started_at=1000) == 0


@given(st.lists(st.lists(st.floats(0.1, 1000), min_size=1, max_size=5, unique=True), min_size=1, max_size=5))
def test_sum_of_every_earlier_attempt(attempts: list[list[float]]) -> None:
    reports, starts, lasts, start = [], [], [], 0.0
    for durations in attempts:
        elapsed = [0.05, *sorted(durations)]  # every attempt's first report is below any earlier one's last
        reports += _attempt(start, elapsed)
        starts.append(start)
        lasts.append(elapsed[-1])
        start += elapsed[-1] + 1.0
    assert earlier_attempts_s(reports, starts[-1]) == sum(lasts[:-1])


def _rows(lrs: list[float], accs: list[float | None]) -> list[dict]:
    return [{"trial_id": str(i), "params": {"finetune.train.base_lr": lr}, "metric": acc}
            for i, (lr, acc) in enumerate(zip(lrs, accs))]


def test_search_points_skip_unscored_trials_and_sort() -> None:
    from vitscale.stages.sweep_results import search_points

    rows = _rows([0.03, 0.001, 0.01], [0.4, 0.6, None])
    assert search_points(rows, "finetune.train.base_lr") == [(0.001, 0.6), (0.03, 0.4)]


def test_one_plot_of_both_searches(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import matplotlib.image

    from vitscale.stages.sweep_results import plot_searches

    x = "finetune.train.base_lr"
    pre = _rows([0.001, 0.003, 0.01], [0.5, 0.7, 0.6])
    scratch = _rows([0.001, 0.003, 0.01], [0.2, 0.25, 0.3])
    path = plot_searches(tmp_path / "lr_vs_accuracy.png", x, "dev_accuracy", [
        ("pre-trained", pre, {"params": {x: 0.003}, "metric": 0.7}, {"test_accuracy": 0.68}),
        ("random weights", scratch, {"params": {x: 0.01}, "metric": 0.3}, {"test_accuracy": 0.29})])
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_pretrain_exaflops_of_a_run_the_sweep_starts_from(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from vitscale.stages.sweep_results import pretrain_exaflops
    from vitscale.train import checkpoint as ckpt

    assert pretrain_exaflops([SimpleNamespace(metrics={"cumulative_exaflops": 0.25}),
                              SimpleNamespace(metrics={"cumulative_exaflops": 0.5})], None) == 0.75
    assert pretrain_exaflops([], None) is None
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"x")
    assert pretrain_exaflops([], str(weights)) is None  # a file from elsewhere says nothing
    run = tmp_path / "run"
    for step in (5, 10):
        directory = run / f"checkpoint_{step:09d}"
        directory.mkdir(parents=True)
        ckpt.write_rank_part(directory, rank=0, stream_state={"epoch": 0, "position": step, "seed": 0},
                             train_state=ckpt.TrainState(step=step, world_size=1, flops=step * 1e17), config_yaml="")
    assert pretrain_exaflops([], str(run)) == 1.0  # the newest complete checkpoint's compute


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_the_reports_trials_saved_as_they_ended_are_the_finished_ones(where: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     request: pytest.FixtureRequest) -> None:
    if where == "s3":
        monkeypatch.setenv("VITSCALE_S3_ENDPOINT_URL", request.getfixturevalue("moto_s3"))
        open_storage("s3://sweep-reports/x").client.create_bucket(Bucket="sweep-reports")
        trials = "s3://sweep-reports/run/sweep/trials"
    else:
        trials = str(tmp_path / "run" / "sweep" / "trials")
    report = {"step": 6, "dev_accuracy": 0.75, "started_at": 1000.5, "finished_at": 1042.25}
    save_final_report(f"{trials}/a_00000", report)
    store = open_storage(trials)
    store.write_bytes("b_00001/checkpoint_000000004/rank0.pt", b"weights")  # still training: no report
    store.write_bytes(f"c_00002/{FINAL_REPORT}", b'{"step": 6, "dev_acc')  # not a report: trained again
    store.write_bytes(f"d_00003/{FINAL_REPORT}", json.dumps({"step": 2}).encode())  # no finish time: not one
    store.write_bytes(f"e_00004/inner/{FINAL_REPORT}", json.dumps(report).encode())  # not a trial's own folder
    assert finished_trials(trials) == {"a_00000": report}
    assert finished_trials(f"{trials}-absent") == {}
