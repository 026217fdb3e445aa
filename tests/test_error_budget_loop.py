"""The training loop keeps the error budget's count in checkpoints: a restart cannot reset it."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from helpers.loop_runs import Recorder, steps
from test_pretrain_loop import tiny_config
from vitscale.data.loader.stream import ErrorBudgetExceeded
from vitscale.data.order import rank_keys
from vitscale.data.tools.write import write_dataset

pytest.importorskip("deepspeed")

# Positions in epoch 0's order (16 samples a step) of the samples to damage: one in each of steps
# 1-5. A budget of 0.02 x 160 samples = 3.2 is exceeded by the 4th, at step 4.
DAMAGED = [0, 20, 40, 52, 70]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("budget") / "ds"
    write_dataset("synthetic", str(out), shard_size=37, max_side=32, seed=0,
                  source_options={"count": 160, "classes": 4, "image_size": 32}, progress=False)
    order = rank_keys(str(out), "train", rank=0, world_size=1, epoch=0, seed=0, shuffle_buffer=64)
    rows = {r["key"]: r for r in pq.read_table(out / "_index.parquet").to_pylist()}
    for position in DAMAGED:
        r = rows[order[position]]
        with open(out / r["shard"], "r+b") as f:
            f.seek(r["offset"] + 100)
            f.write(b"\xab" * (r["size"] - 100))
    return str(out)


def test_restart_goes_on_counting(tmp_path: Path, damaged: str, process_group: None) -> None:
    from vitscale.train.loop import WorkerContext, train

    job = tiny_config(damaged)
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, error_budget=0.02))
    whole = Recorder(tmp_path / "whole")
    (tmp_path / "whole").mkdir()
    with pytest.raises(ErrorBudgetExceeded, match="4 samples skipped in epoch 0"):
        train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=whole))
    assert [m["step"] for m in steps(tmp_path / "run-a")] == [1, 2, 3]
    # Each step's metrics count the samples it consumed, not those of the next step's batch, read ahead.
    assert [m["skipped_samples"] for m in steps(tmp_path / "run-a")] == [1, 2, 3]
    assert [m["step"] for m in whole.metrics] == [3]  # its checkpoint
    checkpoint = tmp_path / "whole" / "checkpoint_000000003"
    # Resumed from step 3 (3 samples skipped so far), the 4th bad sample still stops the run.
    resumed = Recorder(tmp_path / "resumed")
    (tmp_path / "resumed").mkdir()
    with pytest.raises(ErrorBudgetExceeded, match="4 samples skipped in epoch 0"):
        train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-b", report=resumed,
                                 resume_from=checkpoint))
    assert resumed.metrics == [] and steps(tmp_path / "run-b") == []
    shutil.rmtree(tmp_path / "whole")


def test_the_runs_skipped_samples_survive_a_restart_and_an_epoch(tmp_path: Path, damaged: str,
                                                                 process_group: None) -> None:
    """The run's figure (summary table, final JSON): every epoch's skips, a restart's predecessor's included,
    not what rank 0 skipped since its process began."""
    import ray.train

    from vitscale.launch.ray_train import final_metrics
    from vitscale.train.loop import WorkerContext, train

    job = tiny_config(damaged, max_steps=14, checkpoint_every=3)  # 10 steps an epoch: into epoch 1
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, error_budget=1.0))
    whole = Recorder(tmp_path / "whole")
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=whole))
    lines = steps(tmp_path / "run-a")
    assert lines[9]["run_skipped_samples"] == len(DAMAGED)  # epoch 0 read each damaged sample once
    total = lines[-1]["run_skipped_samples"]
    assert total >= len(DAMAGED) and [m["run_skipped_samples"] for m in lines] == \
        sorted(m["run_skipped_samples"] for m in lines)
    for resume_at in (9, 12):  # in epoch 0, and in epoch 1 after epoch 0's end
        again = Recorder(tmp_path / f"again-{resume_at}")
        train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / f"run-{resume_at}", report=again,
                                 resume_from=tmp_path / "whole" / f"checkpoint_{resume_at:09d}"))
        assert again.metrics[-1]["run_skipped_samples"] == total, resume_at
        assert again.metrics[-1]["skipped_samples"] < total  # this process's own count: rank 0 since its start
        result = ray.train.Result(metrics=again.metrics[-1], checkpoint=None, error=None, path=str(tmp_path))
        assert final_metrics(result)["skipped_samples"] == total
