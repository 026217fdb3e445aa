"""Masked patch pre-training in the worker loop: real DeepSpeed ZeRO 0-3, exact resume, transfer of the encoder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.loop_runs import Recorder, steps, weights
from vitscale.data.corruption import corrupted_positions
from vitscale.stages import build_pipeline
from vitscale.stages.pretrain import pretraining_job
from vitscale.train.job import TrainJob

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> str:
    """160 images of 32 px, written without labels (an unlabelled folder: `shards write --source folder:DIR`)."""
    from vitscale.data.tools.write import write_dataset

    out = tmp_path_factory.mktemp("data") / "fractal"
    write_dataset("fractal", str(out), shard_size=37, max_side=32, seed=0,
                  source_options={"count": 160, "classes": 4, "image_size": 32}, progress=False)
    return str(out)


def job(url: str, **train: object) -> TrainJob:
    return pretraining_job(build_pipeline({
        "model": {"name": "ViT-Ti/4", "img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64, "heads": 2},
        "data": {"url": url, "num_workers": 0, "shuffle_buffer": 64},
        "train": {"objective": "masked_patch", "global_batch": 16, "micro_batch": 8, "max_steps": 6,
                  "warmup_steps": 2, "base_lr": 1e-3, "zero_stage": 2, "precision": "fp32", "checkpoint_every": 3,
                  "log_every": 1, "record_samples": True, **train},
        "cluster": {"num_workers": 1, "use_gpu": False},
    }))


def test_the_stream_hands_each_sample_its_own_plan(images: str) -> None:
    """The loader's positions are `corrupted_positions` of (seed, epoch, key), at any world size."""
    from vitscale.data.loader.stream import ShardStream
    from vitscale.train.objective import objective_for

    objective = objective_for(job(images).train, job(images).model)
    corruption = objective.corruption
    assert corruption is not None and corruption.counts == (8, 6, 1)  # a 4 x 4 grid
    seen: dict[str, tuple[list[int], list[int]]] = {}
    for world in (1, 2):
        for rank in range(world):
            stream = ShardStream(images, "train", rank=rank, world_size=world, seed=5, batch_size=8, global_batch=16,
                                 resolution=16, corruption=corruption)
            stream.set_epoch(2)
            for batch in stream:
                expected = corrupted_positions(5, 2, batch["key"], corruption)
                assert torch.equal(batch["positions"], torch.from_numpy(expected[0]))
                assert torch.equal(batch["sources"], torch.from_numpy(expected[1]))
                for key, pos, src in zip(batch["key"], batch["positions"].tolist(), batch["sources"].tolist()):
                    assert seen.setdefault(key, (pos, src)) == (pos, src)
    assert len(seen) == 160


def test_resume_continues_the_same_corruption_and_loss(tmp_path: Path, images: str, process_group: None) -> None:
    from vitscale.train.loop import WorkerContext, train

    config = job(images)
    whole = Recorder(tmp_path / "whole")
    summary = train(config, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=whole))
    assert summary["steps"] == 6 and summary["exaflops"] > 0
    assert all(0.0 <= m["patch_accuracy"] <= 1.0 for m in steps(tmp_path / "run-a"))
    resumed = Recorder(tmp_path / "resumed")
    train(config, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-b", report=resumed,
                                resume_from=tmp_path / "whole" / "checkpoint_000000003"))
    assert [m["step"] for m in steps(tmp_path / "run-b")] == [4, 5, 6]
    for a, b in zip(steps(tmp_path / "run-a")[3:], steps(tmp_path / "run-b"), strict=True):
        assert (a["loss"], a["patch_accuracy"]) == (b["loss"], b["patch_accuracy"])  # bit for bit
    a, b = weights(tmp_path / "whole" / "checkpoint_000000006"), weights(tmp_path / "resumed" / "checkpoint_000000006")
    assert a.keys() == b.keys() and {"mask_token", "head.weight"} <= a.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (3, False), (2, True)])
def test_every_zero_stage_trains_and_transfers_the_encoder(tmp_path: Path, images: str, process_group: None,
                                                           stage: int, offload: bool) -> None:
    """ZeRO 0-3 for real; the checkpoint's encoder (no [mask], no prediction head) is what transfer takes."""
    from vitscale.models import create_model
    from vitscale.models.weights_files import load_pretrained
    from vitscale.train.export import export_run, model_from_checkpoint
    from vitscale.train.loop import WorkerContext, train

    seen = Recorder(tmp_path / "kept")
    train(job(images, zero_stage=stage, offload=offload, max_steps=3, checkpoint_every=3),
          WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run", report=seen))
    trained = weights(tmp_path / "kept" / "checkpoint_000000003")
    assert trained["head.weight"].shape == (512, 32) and trained["mask_token"].shape == (32,)
    encoder, _, facts = model_from_checkpoint(tmp_path / "kept" / "checkpoint_000000003")
    assert facts["objective"] == "masked_patch" and facts["num_classes"] == 0
    assert torch.equal(encoder.state_dict()["blocks.0.attn.qkv.weight"], trained["encoder.blocks.0.attn.qkv.weight"])
    exported = export_run(tmp_path / "kept", tmp_path / "encoder.pt")
    classifier = create_model("ViT-Ti/4", num_classes=10, img_size=16, depth=2, width=32, mlp_dim=64, heads=2)
    report = load_pretrained(classifier, exported["out"])
    assert torch.equal(classifier.state_dict()["blocks.1.mlp.fc2.weight"], trained["encoder.blocks.1.mlp.fc2.weight"])
    assert classifier.head.weight.abs().sum() == 0 and report.head_kept  # the fine-tuning head: zero-initialised


def test_a_sigterm_checkpoints_at_the_next_step_and_the_resumed_run_ends_as_the_whole_one(
        tmp_path: Path, images: str, process_group: None) -> None:
    """A real SIGTERM after step 4 (a preemption): checkpoint of step 5, the rank leaves; resumed from it, the
    run ends with the uninterrupted run's weights: the corrupted patches of step 6 are the same either way."""
    from vitscale.train.loop import WorkerContext, train
    from vitscale.train.termination import Terminated, TerminationNotice

    told = job(images, checkpoint_every=100, fault={"kill_rank": 0, "kill_at_step": 4, "kill_with": "SIGTERM"})
    seen = Recorder(tmp_path / "told")
    with TerminationNotice(60) as notice, pytest.raises(Terminated):
        train(told, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=seen,
                                  terminated=notice.notice))
    assert [p.name for p in (tmp_path / "told").iterdir()] == ["checkpoint_000000005"]
    resumed = Recorder(tmp_path / "resumed")
    train(told, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-b", report=resumed,
                              resume_from=tmp_path / "told" / "checkpoint_000000005"))
    whole = Recorder(tmp_path / "whole")
    train(job(images, checkpoint_every=100), WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-c",
                                                           report=whole))
    a, b = weights(tmp_path / "whole" / "checkpoint_000000006"), weights(tmp_path / "resumed" / "checkpoint_000000006")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert whole.metrics[-1]["patch_accuracy"] == resumed.metrics[-1]["patch_accuracy"]


@pytest.mark.parametrize("target, head", [("downsized_4x4", 16 * 512), ("pixels", 4 * 4 * 3)])
def test_the_appendix_targets_train_in_the_loop(tmp_path: Path, images: str, process_group: None, target: str,
                                                head: int) -> None:
    from vitscale.train.loop import WorkerContext, train

    seen = Recorder(tmp_path / "kept")
    train(job(images, max_steps=2, checkpoint_every=2, masked_patch={"target": target}),
          WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run", report=seen))
    assert weights(tmp_path / "kept" / "checkpoint_000000002")["head.weight"].shape == (head, 32)
    accuracy = [m.get("patch_accuracy") for m in steps(tmp_path / "run")]  # None: no class to be right about
    assert all(a is None for a in accuracy) if target == "pixels" else all(0 <= a <= 1 for a in accuracy)
