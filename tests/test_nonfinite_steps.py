"""The worker loop, one gloo rank, real DeepSpeed: non-finite steps are skipped and budgeted; a changed
run or a foreign stream position is refused on resume."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from vitscale.config.checks import ConfigError
from vitscale.data.tools.write import write_dataset
from vitscale.stages import build_pipeline
from vitscale.stages.pretrain import pretraining_job
from vitscale.train import checkpoint as ckpt
from vitscale.train.job import TrainJob
from vitscale.train.loop import checkpoint_score

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("data") / "synthetic"
    write_dataset("synthetic", str(out), shard_size=40, max_side=32, seed=0,
                  source_options={"count": 80, "classes": 4, "image_size": 32}, progress=False)
    return str(out)


def job(url: str, data: dict | None = None, **train: object) -> TrainJob:
    return pretraining_job(build_pipeline({
        "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2},
        "data": {"url": url, "num_workers": 0, "shuffle_buffer": 16, **(data or {})},
        "train": {"global_batch": 8, "micro_batch": 4, "max_steps": 3, "warmup_steps": 0, "base_lr": 1e-2,
                  "zero_stage": 0, "precision": "fp32", "checkpoint_every": 1, "log_every": 1,
                  "weight_decay": 0.1, **train},
        "cluster": {"num_workers": 1, "use_gpu": False},
    }))


class Keep:
    """The launcher's report hook: keeps every checkpoint and every report."""

    def __init__(self, root: Path):
        self.root, self.metrics = root, []
        root.mkdir(parents=True, exist_ok=True)

    def __call__(self, metrics: dict, checkpoint_dir: Path | None) -> None:
        self.metrics.append(metrics)
        if checkpoint_dir is not None:
            shutil.copytree(checkpoint_dir, self.root / f"checkpoint_{metrics['step']:09d}")


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from vitscale.train.engine import consolidated_state_dict

    return consolidated_state_dict(checkpoint / "deepspeed", "state")


def poison_loss_at(monkeypatch: pytest.MonkeyPatch, steps: set[int], micro_batches_per_step: int) -> None:
    """The loss of one micro-batch of each listed step becomes NaN."""
    from vitscale.train.objective import Supervised

    calls = {"n": 0}
    original = Supervised.loss

    def loss_of(*args, **kwargs):
        calls["n"] += 1
        loss, counts = original(*args, **kwargs)
        step = (calls["n"] - 1) // micro_batches_per_step + 1
        last_micro = (calls["n"] - 1) % micro_batches_per_step == micro_batches_per_step - 1
        return (loss * float("nan") if step in steps and last_micro else loss), counts

    monkeypatch.setattr(Supervised, "loss", loss_of)


def test_checkpoint_score_ranks_every_checkpoint_before_the_first_bad_step_higher() -> None:
    assert checkpoint_score(5, None) > checkpoint_score(4, None)
    assert checkpoint_score(4, first_skipped=5) > checkpoint_score(1000, first_skipped=5) > checkpoint_score(6, 5)


def test_a_nan_loss_step_is_not_applied_and_the_budget_stops_the_run(
        tmp_path: Path, dataset: str, process_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.train.loop import NonFiniteSteps, WorkerContext, train

    poison_loss_at(monkeypatch, {2, 3}, micro_batches_per_step=2)
    keep = Keep(tmp_path / "ckpt")
    with pytest.raises(NonFiniteSteps, match=r"step 3: .*train.max_skipped_steps \(1\).*first at step 2"):
        train(job(dataset, max_skipped_steps=1),
              WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run", report=keep))
    one, two = weights(keep.root / "checkpoint_000000001"), weights(keep.root / "checkpoint_000000002")
    for name in one:  # step 2 (NaN in its second micro-batch) changed nothing, weight decay included
        assert torch.equal(one[name], two[name]), name
        assert torch.isfinite(two[name]).all()
    assert ckpt.read_train_state(keep.root / "checkpoint_000000002").skipped_steps == 1
    assert [m["skipped_steps"] for m in keep.metrics] == [0, 1]
    assert keep.metrics[0]["checkpoint_score"] > keep.metrics[1]["checkpoint_score"]


@pytest.mark.parametrize("stage", [0, 2])
def test_non_finite_gradients_with_a_finite_loss_are_not_applied(
        tmp_path: Path, dataset: str, process_group: None, monkeypatch: pytest.MonkeyPatch, stage: int) -> None:
    """Stage 0: vitscale's guard refuses the step; stage 2: ZeRO skips it itself (counted all the same)."""
    import vitscale.train.worker as worker
    from vitscale.train.loop import WorkerContext, train

    original = worker.build_engine
    seen = {"steps": 0}

    def build_engine(model, train_config, config, **kwargs):
        def poison(grad: torch.Tensor) -> torch.Tensor:
            seen["steps"] += 1
            return grad * float("inf") if seen["steps"] == 2 else grad  # step 2 (one micro-batch per step)

        model.head.weight.register_hook(poison)
        return original(model, train_config, config, **kwargs)

    monkeypatch.setattr(worker, "build_engine", build_engine)
    keep = Keep(tmp_path / "ckpt")
    summary = train(job(dataset, zero_stage=stage, global_batch=4, max_steps=2),
                    WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run", report=keep))
    assert summary["skipped_steps"] == 1 and all(m["loss"] is not None for m in keep.metrics)
    one, two = weights(keep.root / "checkpoint_000000001"), weights(keep.root / "checkpoint_000000002")
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_resume_refuses_a_changed_run_and_a_foreign_stream_position(
        tmp_path: Path, dataset: str, process_group: None) -> None:
    from vitscale.train.loop import WorkerContext, train

    keep = Keep(tmp_path / "ckpt")
    train(job(dataset, max_steps=2), WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run", report=keep))
    saved = keep.root / "checkpoint_000000001"

    with pytest.raises(ConfigError, match=r"data.seed 0 -> 3"):
        train(job(dataset, data={"seed": 3}, max_steps=2),
              WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run", resume_from=saved))

    # A stream position that is not the one step 1 implies (here: one batch further) is refused.
    part = ckpt.read_rank_part(saved, 0)
    ckpt.write_rank_part(saved, rank=0, stream_state={**part["stream"], "position": part["stream"]["position"] + 4},
                         train_state=ckpt.read_train_state(saved), config_yaml=(saved / "config.yaml").read_text())
    with pytest.raises(RuntimeError, match="saved stream position"):
        train(job(dataset, max_steps=2), WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run",
                                                       resume_from=saved))
