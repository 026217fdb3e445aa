"""Images without labels: written, verified, streamed, pre-trained by masked patch prediction, refused by
whatever needs labels (supervised pre-training, the few-shot probe, fine-tuning), each in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from vitscale.cli import main
from vitscale.config.errors import UserError
from vitscale.data.format import read_meta
from vitscale.data.tools.write import write_dataset


def photos(folder: Path, count: int, side: int = 40) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (side, side + 8, 3), dtype=np.uint8)).save(folder / f"img{i:03d}.jpg")
    return folder


@pytest.fixture(scope="module")
def unlabelled(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("unlabelled")
    out = root / "shards"
    write_dataset(f"folder:{photos(root / 'photos', 48)}", str(out), shard_size=20, max_side=32, seed=0,
                  progress=False)
    return str(out)


def test_a_folder_of_images_alone_is_a_dataset_without_labels(unlabelled: str, capsys: pytest.CaptureFixture) -> None:
    meta = read_meta(unlabelled)
    assert (meta.num_classes, meta.classes, meta.labelled, meta.samples("train")) == (0, (), False, 48)
    names = {m.split(".", 1)[1] for m in _members(Path(unlabelled) / "train-000000.tar")}
    assert names == {"jpg"}  # images alone: no label member
    assert main(["shards", "verify", unlabelled]) == 0
    assert main(["shards", "stats", unlabelled]) == 0
    assert "0 classes" in capsys.readouterr().out


def _members(tar: Path) -> list[str]:
    import tarfile

    with tarfile.open(tar) as t:
        return t.getnames()


def test_the_stream_reads_images_without_labels(unlabelled: str) -> None:
    from vitscale.data.loader.stream import ShardStream

    stream = ShardStream(unlabelled, "train", batch_size=16, resolution=16)
    batches = list(stream)
    assert len(batches) == 3 and all(b["valid"].all() and b["label"].eq(0).all() for b in batches)
    assert stream.dataset.num_classes == 0 and stream.skipped() == {}


def test_a_folder_of_images_and_class_folders_is_refused(tmp_path: Path) -> None:
    photos(tmp_path / "mixed", 2)
    photos(tmp_path / "mixed" / "cats", 2)
    with pytest.raises(UserError, match="both images .* and sub-folders"):
        write_dataset(f"folder:{tmp_path / 'mixed'}", str(tmp_path / "out"), progress=False)


def pipeline(url: str, tmp_path: Path, **train: object) -> dict:
    return {"stages": ["pretrain"], "data": {"url": url, "num_workers": 0},
            "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
            "train": {"global_batch": 8, "micro_batch": 4, "max_steps": 1, **train},
            "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "storage_path": str(tmp_path)}}


def run(tmp_path: Path, capsys: pytest.CaptureFixture, raw: dict) -> tuple[int, str]:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    code = main(["run", str(path)])
    return code, capsys.readouterr().err


def test_supervised_pre_training_refuses_images_without_labels_in_one_line(
        unlabelled: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import ray

    code, err = run(tmp_path, capsys, pipeline(unlabelled, tmp_path))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "data.url" in lines[0] and "without labels" in lines[0] and "masked_patch" in lines[0]
    assert not ray.is_initialized()


def test_the_probe_and_fine_tuning_refuse_images_without_labels(unlabelled: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    raw = pipeline(unlabelled, tmp_path, objective="masked_patch")
    raw["stages"] = ["pretrain", "fewshot"]
    raw["fewshot"] = {"datasets": [unlabelled], "shots": [1], "resolution": 16}
    code, err = run(tmp_path, capsys, raw)
    assert code == 2 and "fewshot.datasets[0]" in err and "without labels" in err
    raw["stages"] = ["pretrain", "finetune"]
    raw["finetune"] = {"data": {"url": unlabelled}, "train": {"base_lr": 0.01, "max_steps": 1}, "resolution": 16}
    del raw["fewshot"]
    code, err = run(tmp_path, capsys, raw)
    assert code == 2 and "finetune.data.url" in err and "without labels" in err


def test_a_study_plan_refuses_a_supervised_cell_on_images_without_labels(
        unlabelled: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw = pipeline(unlabelled, tmp_path)
    raw["stages"] = ["study"]
    raw["study"] = {"models": [{"name": "ViT-Ti/8", "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32,
                                "train": {"objective": "masked_patch"}},
                               {"name": "ViT-Ti/8", "depth": 2, "width": 32, "heads": 2, "mlp_dim": 32}],
                    "data_sizes": [None], "transfer": []}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["study", "plan", str(path)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "study.models[1]" in lines[0] and "needs labels" in lines[0], lines
    assert lines[0].count("(in ") <= 1  # the file named once


def test_masked_patch_pre_training_learns_from_images_alone(unlabelled: str, tmp_path: Path,
                                                            process_group: None) -> None:
    from vitscale.stages import build_pipeline
    from vitscale.stages.pretrain import pretraining_job
    from vitscale.train.loop import WorkerContext, train

    raw = pipeline(unlabelled, tmp_path, objective="masked_patch", max_steps=4, zero_stage=1, precision="fp32",
                   checkpoint_every=4, warmup_steps=1)
    seen: list[dict] = []
    summary = train(pretraining_job(build_pipeline(raw)),
                    WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run",
                                  report=lambda metrics, checkpoint: seen.append(metrics)))
    assert summary["steps"] == 4 and summary["num_classes"] == 0
    assert all(np.isfinite(m["loss"]) and m["patch_accuracy"] is not None for m in seen)
