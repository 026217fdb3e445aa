"""The documented Python API (docs/api.md), used as a user would: real shards, a real DataLoader."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import vitscale
from vitscale.data import DatasetWriter, ShardDataset, rank_order
from vitscale.data.tools.verify import verify_dataset


def _image(i: int) -> np.ndarray:
    """A distinct 20x28 RGB image per i: (H, W, 3) uint8."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, size=(20, 28, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("api") / "mine")
    with DatasetWriter(out, name="mine", classes=["cat", "dog", "eel"], shard_size=7) as w:
        for i in range(40):
            form = i % 3  # every form the writer takes: an array, a PIL image, an encoded file's bytes
            img: np.ndarray | Image.Image | bytes = _image(i)
            if form == 1:
                img = Image.fromarray(_image(i))
            elif form == 2:
                buf = io.BytesIO()
                Image.fromarray(_image(i)).save(buf, format="PNG")
                img = buf.getvalue()
            w.add(img, i % 3)
        for i in range(5):
            w.add(_image(100 + i)[:, :, 0], i % 3, split="test", key=f"grey-{i}")  # a grey (H, W) array
    return out


def test_writer_makes_a_valid_dataset(shards: str) -> None:
    assert verify_dataset(shards) == []
    meta = json.loads((Path(shards) / "dataset.json").read_text())
    assert meta["name"] == "mine" and meta["classes"] == ["cat", "dog", "eel"] and meta["num_classes"] == 3
    assert meta["splits"]["train"]["samples"] == 40 and meta["splits"]["test"]["samples"] == 5
    assert len(meta["splits"]["train"]["shards"]) == 6  # 40 samples, 7 a shard
    assert (Path(shards) / "_index.parquet").is_file()


def test_writer_refuses_bad_samples_and_leaves_nothing_on_error(tmp_path: Path) -> None:
    out = tmp_path / "bad"
    with (pytest.raises(ValueError, match=r"label: class index \[2\] outside \[0, 2\)"),
          DatasetWriter(str(out), name="bad", classes=["a", "b"]) as w):
        w.add(_image(0), 0)
        w.add(_image(1), 2)
    assert not (out / "dataset.json").exists()
    with DatasetWriter(str(out), name="ok", classes=["a", "b"]) as w:  # the same place works again
        w.add(_image(0), 1, key="x")
        with pytest.raises(ValueError, match="'x' was added before"):
            w.add(_image(1), 0, key="x")
        with pytest.raises(ValueError, match="uint8"):
            w.add(np.zeros((4, 4, 3), np.float32), 0)
    assert verify_dataset(str(out)) == []
    with pytest.raises(ValueError, match="already holds a dataset"):
        DatasetWriter(str(out), name="again", classes=["a"])


@pytest.mark.parametrize("label", [1.5, True, None, "cow", np.float32(1.0)])
def test_a_label_of_another_kind_is_refused_not_rounded(tmp_path: Path, label: object) -> None:
    """A float or a bool is a label of some other kind passed by mistake: 1.5 is not class 1, True not class 1."""
    with (pytest.raises(ValueError, match=r"^label: (a class index \(an int\) or a class name, got|'cow' is not one)"),
          DatasetWriter(str(tmp_path / "d"), name="d", classes=["cat", "dog"]) as w):
        w.add(_image(0), label)  # type: ignore[arg-type]
    assert not (tmp_path / "d" / "dataset.json").exists()


def test_a_label_may_be_a_class_name_or_a_numpy_index(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    with DatasetWriter(str(tmp_path / "d"), name="d", classes=["cat", "dog"]) as w:
        w.add(_image(0), "dog", key="named")
        w.add(_image(1), np.int64(0), key="numpy")
    with DatasetWriter(str(tmp_path / "m"), name="m", classes=["cat", "dog"], multi_label=True) as w:
        w.add(_image(0), ["dog", "cat"], key="both")
        w.add(_image(1), np.array([1]), key="one")
    labels = {r["key"]: r["labels"] for d in ("d", "m")
              for r in pq.read_table(tmp_path / d / "_index.parquet").to_pylist()}
    assert labels == {"named": [1], "numpy": [0], "both": [0, 1], "one": [1]}
    with pytest.raises(ValueError, match=r"^classes: must be distinct class names, at least one; got 'ab'"):
        DatasetWriter(str(tmp_path / "s"), name="s", classes="ab")  # a string is no list of names


def _keys(batches: list[dict]) -> list[str]:
    return [k for b in batches for k in b["key"]]


def test_dataset_in_a_dataloader_resumes_exactly(shards: str) -> None:
    def make() -> ShardDataset:
        return ShardDataset(shards, "train", batch_size=4, resolution=16, seed=3,
                            transform=lambda hwc: torch.from_numpy(hwc).permute(2, 0, 1).float() / 255)

    full = list(DataLoader(make(), batch_size=None, num_workers=2))
    assert len(full) == 10 and all(b["image"].shape == (4, 3, 16, 16) for b in full)
    assert full[0]["image"].dtype == torch.float32 and full[0]["label"].dtype == torch.int64
    assert sorted(_keys(full)) == sorted(f"train-{i:08d}" for i in range(40))  # each sample once
    assert full[3]["state"] == {"epoch": 0, "position": 16, "seed": 3}
    assert full[-1]["state"] == {"epoch": 1, "position": 0, "seed": 3}

    resumed = make()
    resumed.load_state_dict(full[3]["state"])  # as if the run stopped after its 4th batch
    rest = list(DataLoader(resumed, batch_size=None, num_workers=1))  # another worker count
    assert _keys(rest) == _keys(full[4:])
    for a, b in zip(rest, full[4:]):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])

    # In this process the dataset's own state follows the batches handed out.
    here = make()
    it = iter(here)
    for _ in range(4):
        next(it)
    assert here.state_dict() == full[3]["state"]
    # The next epoch is another order of the same samples.
    again = make()
    again.set_epoch(1)
    second = list(DataLoader(again, batch_size=None))
    assert sorted(_keys(second)) == sorted(_keys(full)) and _keys(second) != _keys(full)


def test_dataset_without_transform_and_for_evaluation(shards: str) -> None:
    ds = ShardDataset(shards, "test", batch_size=2, resolution=8, train=False)
    batches = list(ds)
    assert [b["image"].shape[0] for b in batches] == [2, 2, 1]  # evaluation keeps the partial batch
    assert batches[0]["image"].dtype == torch.uint8 and ds.classes == ("cat", "dog", "eel")
    assert _keys(batches) == [f"grey-{i}" for i in range(5)]
    with pytest.raises(TypeError, match="must return a torch.Tensor"):
        list(ShardDataset(shards, "test", batch_size=2, resolution=8, transform=lambda hwc: hwc))


def test_rank_order_splits_an_epoch_between_ranks() -> None:
    counts = [7, 7, 7, 5]
    parts = [rank_order(counts, seed=1, epoch=0, rank=r, world_size=3).global_indices() for r in range(3)]
    seen = np.concatenate(parts)
    assert len(set(seen.tolist())) == len(seen) == 3 * (sum(counts) // 3)


def test_create_model_takes_timm_names() -> None:
    with torch.device("meta"):
        model = vitscale.create_model("vit_base_patch16_384", num_classes=10)
        hybrid = vitscale.create_model("vit_base_r50_s16_384", num_classes=10)
        plain = vitscale.create_model("ViT-B/16", num_classes=10)
    assert model.spec.name == "ViT-B/16" and model.img_size == 384 and plain.img_size == 224
    assert hybrid.spec.name == "R50x1+ViT-B/16" and hybrid.img_size == 384
    assert sum(p.numel() for p in model.parameters()) > 85_000_000
    with pytest.raises(ValueError, match="did you mean 'vit_base_patch16_224'"):
        vitscale.create_model("vit_bsae_patch16_224", num_classes=10)


def test_top_level_names_and_no_torch_at_import() -> None:
    import subprocess

    code = "import sys, vitscale; assert 'torch' not in sys.modules; print(vitscale.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == vitscale.__version__
    assert set(vitscale.__all__) <= set(dir(vitscale))
    config = vitscale.load_pipeline("quickstart", ["name=notebook"])  # a shipped pipeline by name
    assert config.name == "notebook" and "pretrain" in config.stages and callable(vitscale.run_pipeline)


def test_cli_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from vitscale.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"vitscale {vitscale.__version__}"
    # pyproject.toml reads the version from vitscale/_version.py, so the installed metadata agrees.
    from importlib.metadata import version

    assert version("vitscale") == vitscale.__version__


def test_dataset_over_its_error_budget_names_the_damaged_shards(tmp_path: Path) -> None:
    """Iterated here, past `error_budget` the dataset stops with the shared error: the count, the budget and
    each shard that held a damaged sample with how many, not just that something was skipped."""
    from helpers.datasets import write_test_dataset
    from vitscale.data.loader.stream import ErrorBudgetExceeded

    def damage(key: str, sample: dict[str, bytes]) -> dict[str, bytes]:
        # Samples 5-7 (the second shard) and 13 (the fourth): JPEG headers with nothing after them.
        return {**sample, "jpg": sample["jpg"][:20]} if key in {f"train{i:06d}" for i in (5, 6, 7, 13)} else sample

    root = write_test_dataset(tmp_path / "d", {"train": [4, 4, 4, 4]}, num_classes=3, size=(20, 16), hook=damage)
    kept = ShardDataset(str(root), "train", batch_size=4, resolution=8, error_budget=0.25, seed=1)
    seen = {k for b in kept for k in b["key"]}  # 4 skipped, within a quarter of 16
    assert len(seen) == 12 and not seen & {f"train{i:06d}" for i in (5, 6, 7, 13)}
    over = ShardDataset(str(root), "train", batch_size=4, resolution=8, error_budget=0.1, seed=1)
    with pytest.raises(ErrorBudgetExceeded, match=r"over the error budget 0\.1 of 16 samples") as error:
        list(over)
    assert "train-000001.tar (" in str(error.value) and "rank" not in str(error.value)
