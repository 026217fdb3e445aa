"""Uneven shares end to end, without Ray: the real loop (`vitscale.train.loop.train`) in separate processes
over gloo, real DeepSpeed ZeRO 2, a tiny ViT, a global batch of 16.

    world 1: one rank takes all 16 examples of a step (4 micro-batches of 4)
    world 3: 3 does not divide 16: shares of 5, 5 and 6, each in 2 micro-batches (3+2, 3+2, 3+3), the
             losses weighted by n * W * accum / G (`optim.loss_weight`)

Both runs must consume exactly the same samples at every step and reach the same weights: the
gradient of each step is (1/G) x the sum of per-example gradients at any world size. Not bit for
bit: the sums run in another order (per rank, then over gloo), so fp32 rounding differs (~1e-7
relative per step), and AdamW's m / sqrt(v) can carry that to a few 1e-6 on the weights (measured:
2.2e-6); the tests allow 2e-5, against a run that moves the weights by 2e-3 (checked too). Without
the loss weights (the plain mean of the ranks' micro-batch means) the difference was 1.8e-3. About
25 s on 2 CPU cores, most of it process and DeepSpeed start-up.

Launched as a worker: `python tests/test_uneven_shares.py OUT DATA` with RANK / WORLD_SIZE in the environment.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.gloo_ranks import launch_ranks, leave
from helpers.loop_runs import steps

GLOBAL_BATCH = 16
MICRO_BATCH = 4
STEPS = 4
WORLDS = (1, 3)
TOLERANCE = 2e-5


def _job(data: str) -> Any:
    from vitscale.stages import build_pipeline
    from vitscale.stages.pretrain import pretraining_job

    return pretraining_job(build_pipeline({
        "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64, "heads": 2},
        "data": {"url": data, "num_workers": 0, "shuffle_buffer": 64},
        "train": {"global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH, "max_steps": STEPS, "warmup_steps": 1,
                  "base_lr": 1e-3, "zero_stage": 2, "precision": "fp32", "checkpoint_every": STEPS,
                  "log_every": 1, "record_samples": True},
        "cluster": {"num_workers": [1, 3], "use_gpu": False},  # an elastic range: 3 need not divide 16
    }))


def worker(out: Path, data: str) -> None:
    from vitscale.train.loop import WorkerContext, train

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run = out / f"w{world}"

    def report(metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        if checkpoint_dir is not None:  # every rank's files into one folder: the whole ZeRO checkpoint
            shutil.copytree(checkpoint_dir, run / "checkpoint", dirs_exist_ok=True)

    summary = train(_job(data), WorkerContext(rank=rank, world_size=world, run_dir=run, report=report, elastic=True))
    losses = [row["loss"] for row in steps(run, rank)]  # every step's, from the rank's metrics file
    (run / f"summary-r{rank}.json").write_text(json.dumps({"summary": summary, "losses": losses}, default=str))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("deepspeed")
    from vitscale.data.tools.write import write_dataset

    out = tmp_path_factory.mktemp("uneven")
    data = out / "synthetic"
    write_dataset("synthetic", str(data), shard_size=37, max_side=32, seed=0,
                  source_options={"count": 160, "classes": 4, "image_size": 32}, progress=False)
    for world in WORLDS:
        launch_ranks(__file__, out, world, str(out), str(data))
    return out


def _steps(run: Path, world: int) -> dict[int, list[list[str]]]:
    """Per step, each rank's keys (the last line of a step wins, as after a resume)."""
    steps: dict[int, list[list[str]]] = {}
    for rank in range(world):
        for line in (run / "samples" / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], [[] for _ in range(world)])[rank] = record["keys"]
    return steps


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from vitscale.train.engine import consolidated_state_dict

    return {k: v.detach() for k, v in consolidated_state_dict(run / "checkpoint" / "deepspeed", "state").items()}


@pytest.mark.slow
def test_every_step_consumes_the_same_samples_at_3_workers_as_at_1(runs: Path) -> None:
    one, three = _steps(runs / "w1", 1), _steps(runs / "w3", 3)
    assert sorted(one) == sorted(three) == list(range(1, STEPS + 1))
    for step in one:
        assert [len(keys) for keys in three[step]] == [5, 5, 6]  # [r*16//3, (r+1)*16//3)
        together = [k for keys in three[step] for k in keys]
        assert len(set(together)) == GLOBAL_BATCH == len(together)
        assert together == one[step][0]  # the same samples, in the same order: the shares tile the batch


@pytest.mark.slow
def test_3_uneven_workers_reach_the_weights_and_losses_of_1(runs: Path) -> None:
    one, three = _weights(runs / "w1"), _weights(runs / "w3")
    assert one.keys() == three.keys()
    worst = max(float((one[k] - three[k]).abs().max()) for k in one)
    assert worst < TOLERANCE, f"largest weight difference {worst}"
    # The tolerance is far below what the run moved the weights: a wrong weighting (e.g. the plain
    # mean of the ranks' micro-batch means) would show at this scale.
    job = _job(str(runs / "synthetic"))
    torch.manual_seed(job.train.seed)  # the loop's initial weights
    initial = job.model.build(4).state_dict()
    assert one.keys() == initial.keys()
    moved = max(float((one[k] - initial[k]).abs().max()) for k in one)
    assert moved > 100 * TOLERANCE, f"the run moved the weights by {moved} only"
    summaries = {w: [json.loads((runs / f"w{w}" / f"summary-r{r}.json").read_text()) for r in range(w)]
                 for w in WORLDS}
    losses_one, losses_three = summaries[1][0]["losses"], summaries[3][0]["losses"]
    assert len(losses_one) == len(losses_three) == STEPS
    assert losses_one == pytest.approx(losses_three, rel=1e-5)  # the reported loss: the global batch's mean
    assert all(s["summary"]["examples_seen"] == STEPS * GLOBAL_BATCH for w in WORLDS for s in summaries[w])


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2])
    leave()
