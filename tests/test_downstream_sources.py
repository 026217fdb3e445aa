"""Transfer-dataset sources (CIFAR-10/100 binary, Pets, Flowers-102, ImageNet) from tiny files in
exactly their distributed formats: no download, ever."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy.io import savemat

from vitscale.cli import main
from vitscale.data.format import read_meta
from vitscale.data.tools.sources import image_of, open_source
from vitscale.data.tools.verify import verify_dataset
from vitscale.data.tools.write import write_dataset

WRITE = dict(shard_size=4, max_side=64, quality=95, progress=False, workers=2)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def read_written(out: Path) -> dict[str, tuple[str, np.ndarray, int]]:
    """key -> (split, decoded RGB pixels, label) of every sample in a written dataset's shards."""
    meta = read_meta(str(out))
    got: dict[str, tuple[str, np.ndarray, int]] = {}
    for split, sp in meta.splits.items():
        for shard in sp.shards:
            with tarfile.open(out / shard.name) as tar:
                members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
            for name, data in members.items():
                if name.endswith(".jpg"):
                    key = name[:-4]
                    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
                    got[key] = (split, pixels, int(members[f"{key}.cls"]))
    return got


def _jpeg(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (12, 10)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, format="JPEG")


# ------------------------------------------------------------------------------------------ CIFAR


def _cifar_images(n: int, seed: int) -> np.ndarray:
    """(n, 3, 32, 32) uint8: smooth gradients with a per-image colour, so JPEG keeps them close."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:32, 0:32]
    base = rng.integers(20, 200, size=(n, 3, 1, 1))
    return (base + (x + y)[None, None] + np.arange(3)[None, :, None, None] * 5).astype(np.uint8)


def _cifar_file(path: Path, labels: list[list[int]], images: np.ndarray) -> None:
    """Records of label byte(s) + 1024 R + 1024 G + 1024 B (row-major), as the binary version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(bytes(lab) + img.tobytes() for lab, img in zip(labels, images, strict=True)))


CIFAR10_COUNTS = {"data_batch_1.bin": 3, "data_batch_2.bin": 2, "data_batch_3.bin": 1,
                  "data_batch_4.bin": 2, "data_batch_5.bin": 1, "test_batch.bin": 3}
CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture()
def cifar10(tmp_path: Path) -> tuple[Path, dict[str, tuple[np.ndarray, int]]]:
    """A tiny ``cifar-10-batches-bin/`` (inside tmp_path/dl) and key -> (CHW pixels, label)."""
    folder = tmp_path / "dl" / "cifar-10-batches-bin"
    truth: dict[str, tuple[np.ndarray, int]] = {}
    for f, (name, n) in enumerate(CIFAR10_COUNTS.items()):
        images = _cifar_images(n, seed=f)
        labels = [(3 * f + r) % 10 for r in range(n)]
        _cifar_file(folder / name, [[lab] for lab in labels], images)
        truth.update({f"{Path(name).stem}_{r:05d}": (images[r], labels[r]) for r in range(n)})
    (folder / "batches.meta.txt").write_text("\n".join(CIFAR10_NAMES) + "\n\n")  # blank tail, as shipped
    return folder, truth


def test_cifar10_source_reads_records_exactly(cifar10) -> None:
    folder, truth = cifar10
    src = open_source(f"cifar10:{folder.parent}")  # the parent of cifar-10-batches-bin/ works too
    assert src.classes == tuple(CIFAR10_NAMES) and len(src) == 12 and not src.multi_label
    assert {k: len(v) for k, v in src.predefined_splits().items()} == {"train": 9, "test": 3}
    for sample in src:
        chw, label = truth[sample.key]
        assert sample.labels == (label,)
        assert np.array_equal(np.asarray(image_of(sample.image)), chw.transpose(1, 2, 0))


def test_cifar10_written_end_to_end(cifar10, tmp_path: Path) -> None:
    folder, truth = cifar10
    meta = write_dataset(f"cifar10:{folder}", str(tmp_path / "out"), **WRITE)
    assert meta["classes"] == CIFAR10_NAMES and meta["num_classes"] == 10
    assert {s: v["samples"] for s, v in meta["splits"].items()} == {"train": 9, "test": 3}
    assert verify_dataset(str(tmp_path / "out")) == []
    got = read_written(tmp_path / "out")
    assert set(got) == set(truth)
    for key, (split, pixels, label) in got.items():
        chw, want = truth[key]
        assert label == want and split == ("test" if key.startswith("test_batch") else "train")
        assert np.abs(pixels.astype(int) - chw.transpose(1, 2, 0)).mean() < 3, key


def test_cifar10_via_cli_and_split_flag_refused(cifar10, tmp_path: Path, capsys) -> None:
    folder, _ = cifar10
    out = str(tmp_path / "cli")
    assert main(["shards", "write", "--source", f"cifar10:{folder}", "--out", out, "--shard-size", "5"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["classes"] == 10 and printed["samples"] == {"train": 9, "test": 3}
    assert main(["shards", "write", "--source", f"cifar10:{folder}", "--out", str(tmp_path / "x"),
                 "--split", "train=0.9,test=0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--split" in err and "own splits" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_cifar100_uses_the_fine_label(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-binary"
    images = _cifar_images(5, seed=7)
    fine, coarse = [0, 99, 42, 7, 42], [0, 19, 3, 1, 3]
    _cifar_file(folder / "train.bin", [[c, f] for c, f in zip(coarse[:3], fine[:3])], images[:3])
    _cifar_file(folder / "test.bin", [[c, f] for c, f in zip(coarse[3:], fine[3:])], images[3:])
    names = [f"fine{i}" for i in range(100)]
    (folder / "fine_label_names.txt").write_text("\n".join(names) + "\n")
    (folder / "coarse_label_names.txt").write_text("\n".join(f"coarse{i}" for i in range(20)) + "\n")
    src = open_source(f"cifar100:{folder}")
    assert src.classes == tuple(names)
    assert [s.labels[0] for s in src] == fine
    assert [s.key for s in src] == ["train_00000", "train_00001", "train_00002", "test_00000", "test_00001"]
    assert np.array_equal(np.asarray(image_of(src[4].image)), images[4].transpose(1, 2, 0))
    meta = write_dataset(f"cifar100:{folder}", str(tmp_path / "out"), **WRITE)
    assert meta["num_classes"] == 100 and meta["splits"]["test"]["samples"] == 2
    assert {k: v[2] for k, v in read_written(tmp_path / "out").items()} == \
        {s.key: s.labels[0] for s in src}


def test_cifar_bad_files_are_named(cifar10, tmp_path: Path) -> None:
    folder, _ = cifar10
    batch = folder / "data_batch_2.bin"
    good = batch.read_bytes()
    batch.write_bytes(good[:-1])  # truncated
    with pytest.raises(ValueError, match="whole number of 3073-byte records") as exc:
        open_source(f"cifar10:{folder}")
    assert str(batch) in _one_line(exc)
    batch.write_bytes(bytes([10]) + good[1:])  # label 10 of 10 classes
    with pytest.raises(ValueError, match=r"record 0 has label 10, outside \[0, 10\)") as exc:
        open_source(f"cifar10:{folder}")
    assert str(batch) in _one_line(exc)
    batch.write_bytes(good)
    (folder / "test_batch.bin").unlink()
    with pytest.raises(ValueError, match="does not exist") as exc:
        open_source(f"cifar10:{folder}")
    assert str(folder / "test_batch.bin") in _one_line(exc)
    (folder / "batches.meta.txt").write_text("cat\ndog\n")
    with pytest.raises(ValueError, match="names 2 classes, expected 10") as exc:
        open_source(f"cifar10:{folder}")
    assert str(folder / "batches.meta.txt") in _one_line(exc)


# ------------------------------------------------------------------------------------------- Pets


PETS = {"trainval.txt": [("Abyssinian_1", 1), ("american_bulldog_10", 2), ("Bengal_3", 3), ("Abyssinian_2", 1)],
        "test.txt": [("american_bulldog_11", 2), ("Bengal_4", 3)]}


@pytest.fixture()
def pets(tmp_path: Path) -> Path:
    root = tmp_path / "pets"
    (root / "annotations").mkdir(parents=True)
    for fname, rows in PETS.items():
        lines = ["#Image CLASS-ID SPECIES BREED ID", "#ID: 1:37 Class ids"]
        for n, (image, cid) in enumerate(rows):
            lines.append(f"{image} {cid} {1 if image[0].isupper() else 2} {cid}")
            _jpeg(root / "images" / f"{image}.jpg", (40 * cid, 10 * n, 100))
        (root / "annotations" / fname).write_text("\n".join(lines) + "\n")
    return root


def test_pets_source_and_write(pets: Path, tmp_path: Path) -> None:
    src = open_source(f"pets:{pets}")
    assert src.classes == ("Abyssinian", "american_bulldog", "Bengal")
    assert {k: len(v) for k, v in src.predefined_splits().items()} == {"train": 4, "test": 2}
    want = {image: cid - 1 for rows in PETS.values() for image, cid in rows}
    assert {s.key: s.labels[0] for s in src} == want
    meta = write_dataset(f"pets:{pets}", str(tmp_path / "out"), **WRITE)
    assert meta["classes"] == ["Abyssinian", "american_bulldog", "Bengal"]
    got = read_written(tmp_path / "out")
    assert {k: v[2] for k, v in got.items()} == want
    assert {k for k, v in got.items() if v[0] == "test"} == {"american_bulldog_11", "Bengal_4"}
    assert tuple(got["Bengal_3"][1][0, 0]) == pytest.approx((120, 20, 100), abs=4)


def test_pets_bad_inputs_are_named(pets: Path) -> None:
    (pets / "images" / "Bengal_4.jpg").unlink()
    with pytest.raises(ValueError, match="does not exist") as exc:
        open_source(f"pets:{pets}")
    assert "Bengal_4.jpg" in _one_line(exc) and "test.txt:4" in str(exc.value)
    test = pets / "annotations" / "test.txt"
    test.write_text("Bengal_3 38 1 1\n")
    with pytest.raises(ValueError, match="class id 38 outside 1..37") as exc:
        open_source(f"pets:{pets}")
    assert f"{test}:1" in _one_line(exc)
    test.unlink()
    with pytest.raises(ValueError, match="does not exist") as exc:
        open_source(f"pets:{pets}")
    assert str(test) in _one_line(exc)


# ---------------------------------------------------------------------------------------- Flowers


FLOWER_LABELS = [5, 5, 102, 1, 77, 1, 102, 77]
FLOWER_SETS = {"trnid": [1, 4, 7], "valid": [2, 8], "tstid": [3, 5, 6]}


@pytest.fixture()
def flowers(tmp_path: Path) -> Path:
    root = tmp_path / "102flowers"
    for i, label in enumerate(FLOWER_LABELS, start=1):
        _jpeg(root / "jpg" / f"image_{i:05d}.jpg", (2 * label, 30, 200), size=(16, 12))
    savemat(root / "imagelabels.mat", {"labels": np.array([FLOWER_LABELS], dtype=np.uint8)})
    savemat(root / "setid.mat", {k: np.array([v], dtype=np.uint16) for k, v in FLOWER_SETS.items()})
    return root


def test_flowers_source_and_write(flowers: Path, tmp_path: Path) -> None:
    src = open_source(f"flowers:{flowers}")
    assert len(src.classes) == 102 and src.classes[0] == "1" and src.classes[101] == "102"
    sizes = {k: len(v) for k, v in src.predefined_splits().items()}
    assert sizes == {"train": 3, "val": 2, "test": 3}
    want = {f"image_{i:05d}": label - 1 for i, label in enumerate(FLOWER_LABELS, start=1)}
    assert {s.key: s.labels[0] for s in src} == want
    write_dataset(f"flowers:{flowers}", str(tmp_path / "out"), **WRITE)
    got = read_written(tmp_path / "out")
    assert {k: v[2] for k, v in got.items()} == want
    split_of = {f"image_{i:05d}": s for s, v in zip(("train", "val", "test"), FLOWER_SETS.values()) for i in v}
    assert {k: v[0] for k, v in got.items()} == split_of


def test_flowers_bad_inputs_are_named(flowers: Path) -> None:
    (flowers / "jpg" / "image_00005.jpg").unlink()
    with pytest.raises(ValueError, match="does not exist") as exc:
        open_source(f"flowers:{flowers}")
    assert "image_00005.jpg" in _one_line(exc) and "tstid" in str(exc.value)
    savemat(flowers / "imagelabels.mat", {"labels": np.array([[103, *FLOWER_LABELS[1:]]], dtype=np.uint8)})
    with pytest.raises(ValueError, match=r"label 103, outside 1\.\.102") as exc:
        open_source(f"flowers:{flowers}")
    assert str(flowers / "imagelabels.mat") in _one_line(exc)
    savemat(flowers / "imagelabels.mat", {"labels": np.array([FLOWER_LABELS], dtype=np.uint8)})
    savemat(flowers / "setid.mat", {"trnid": np.array([[1]]), "valid": np.array([[2]])})
    with pytest.raises(ValueError, match="has no variable 'tstid'") as exc:
        open_source(f"flowers:{flowers}")
    assert str(flowers / "setid.mat") in _one_line(exc)
    (flowers / "setid.mat").unlink()
    with pytest.raises(ValueError, match="does not exist") as exc:
        open_source(f"flowers:{flowers}")
    assert str(flowers / "setid.mat") in _one_line(exc)


# --------------------------------------------------------------------------------------- ImageNet


WNIDS = ("n01440764", "n01443537", "n02119789")
VAL_TRUTH = ["n02119789", "n01440764", "n02119789", "n01443537"]  # val_00000001 .. 00000004


def _imagenet(root: Path, kaggle: bool = False) -> Path:
    """train/<wnid>/ (2 images each) and val/ILSVRC2012_val_0000000N.JPEG; returns the image root."""
    base = root / "ILSVRC" / "Data" / "CLS-LOC" if kaggle else root
    for c, wnid in enumerate(WNIDS):
        for n in range(2):
            _jpeg(base / "train" / wnid / f"{wnid}_{n}.JPEG", (80 * c, 10 * n, 50))
    for n, wnid in enumerate(VAL_TRUTH, start=1):
        _jpeg(base / "val" / f"ILSVRC2012_val_{n:08d}.JPEG", (80 * WNIDS.index(wnid), 200, 50))
    return base


def _check_imagenet(spec: str) -> None:
    src = open_source(spec)
    assert src.classes == WNIDS
    assert {k: len(v) for k, v in src.predefined_splits().items()} == {"train": 6, "val": 4}
    labels = {s.key: s.labels[0] for s in src}
    assert labels["n01443537_1"] == 1
    assert [labels[f"ILSVRC2012_val_{n:08d}"] for n in range(1, 5)] == [WNIDS.index(w) for w in VAL_TRUTH]


def test_imagenet_kaggle_layout(tmp_path: Path) -> None:
    _imagenet(tmp_path, kaggle=True)
    (tmp_path / "LOC_synset_mapping.txt").write_text(
        "n01440764 tench, Tinca tinca\nn01443537 goldfish, Carassius auratus\nn02119789 kit fox, Vulpes macrotis\n")
    rows = [f"ILSVRC2012_val_{n:08d},{w} 1 2 30 40 {w} 5 6 7 8" for n, w in enumerate(VAL_TRUTH, start=1)]
    (tmp_path / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "\n".join(rows[::-1]) + "\n")
    _check_imagenet(f"imagenet:{tmp_path}")
    meta = write_dataset(f"imagenet:{tmp_path}", str(tmp_path / "out"), **WRITE)
    assert meta["classes"] == list(WNIDS) and meta["splits"]["val"]["samples"] == 4
    got = read_written(tmp_path / "out")
    assert got["ILSVRC2012_val_00000003"][:1] == ("val",) and got["ILSVRC2012_val_00000003"][2] == 2
    # a listed image that is missing
    (tmp_path / "ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_00000002.JPEG").unlink()
    with pytest.raises(ValueError, match="image ILSVRC2012_val_00000002 is not in") as exc:
        open_source(f"imagenet:{tmp_path}")
    assert "LOC_val_solution.csv:4" in _one_line(exc)


def test_imagenet_devkit_ids_map_through_meta_mat(tmp_path: Path) -> None:
    _imagenet(tmp_path)
    data = tmp_path / "ILSVRC2012_devkit_t12" / "data"
    data.mkdir(parents=True)
    # The devkit's ILSVRC2012_IDs are not in wnid order: id 1 is n02119789 (kit fox).
    ids = {"n02119789": 1, "n01440764": 2, "n01443537": 3}
    synsets = np.array([[(i, w, "words")] for w, i in ids.items()],
                       dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O")])
    (data / "ILSVRC2012_validation_ground_truth.txt").write_text("\n".join(str(ids[w]) for w in VAL_TRUTH) + "\n")
    with pytest.raises(ValueError, match="meta.mat does not exist") as exc:
        open_source(f"imagenet:{tmp_path}")
    _one_line(exc)
    savemat(data / "meta.mat", {"synsets": synsets})
    _check_imagenet(f"imagenet:{tmp_path}")
    (data / "ILSVRC2012_validation_ground_truth.txt").write_text("1\n2\n3\n")
    with pytest.raises(ValueError, match="has 3 labels but .* holds 4 images") as exc:
        open_source(f"imagenet:{tmp_path}")
    assert "ILSVRC2012_validation_ground_truth.txt" in _one_line(exc)


def test_imagenet_val_class_folders_and_missing_labels(tmp_path: Path) -> None:
    base = _imagenet(tmp_path)
    with pytest.raises(ValueError, match="no labels for") as exc:
        open_source(f"imagenet:{tmp_path}")
    assert str(base / "val") in _one_line(exc)
    for n, wnid in enumerate(VAL_TRUTH, start=1):
        name = f"ILSVRC2012_val_{n:08d}.JPEG"
        (base / "val" / wnid).mkdir(exist_ok=True)
        (base / "val" / name).rename(base / "val" / wnid / name)
    _check_imagenet(f"imagenet:{tmp_path}")


def test_predefined_splits_in_config_and_needs_a_path(tmp_path: Path) -> None:
    from vitscale.config.checks import ConfigError
    from vitscale.data.config import SourceConfig

    SourceConfig(kind=f"cifar10:{tmp_path}").validate("data.create_if_missing")
    with pytest.raises(ConfigError, match="data.create_if_missing.splits"):
        SourceConfig(kind=f"pets:{tmp_path}", splits={"train": 1.0}).validate("data.create_if_missing")
    with pytest.raises(ValueError, match="needs a path"):
        open_source("flowers")
    with pytest.raises(ValueError, match="source 'flowers102' is now named 'flowers'") as exc:
        open_source(f"flowers102:{tmp_path}")
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="data.create_if_missing.kind: source 'flowers102' is now named"):
        SourceConfig(kind=f"flowers102:{tmp_path}").validate("data.create_if_missing")
    with pytest.raises(ValueError, match="does not take option"):
        open_source(f"cifar10:{tmp_path}", count=3)
