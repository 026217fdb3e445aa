"""`vitscale shards index`: WebDataset tars written by others train like a vitscale dataset."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from vitscale.cli import main
from vitscale.data.format import SPLIT_NAME, open_dataset, read_index, read_meta, split_of_shard
from vitscale.data.loader.stream import ShardStream
from vitscale.data.storage import open_storage
from vitscale.data.tools.adopt import expand_braces, index_shards, split_url
from vitscale.data.tools.verify import verify_dataset

NAMES = ["cat", "dog", "owl"]


def _image(seed: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((20, 24, 3), seed * 20 % 255, np.uint8)).save(buf, fmt)
    return buf.getvalue()


def _tars(root: Path, shards: int = 3, per: int = 4) -> Path:
    """img2dataset-style shards: jpg/png/webp images, .cls ids, .txt names and .json metadata."""
    root.mkdir(parents=True, exist_ok=True)
    n = 0
    for s in range(shards):
        with wds.TarWriter(str(root / f"train-{s:06d}.tar")) as tw:
            for _ in range(per):
                fmt, ext = [("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp")][n % 3]
                tw.write({"__key__": f"{n:09d}", ext: _image(n, fmt), "cls": str(n % 3).encode(),
                          "txt": NAMES[n % 3].encode(), "json": json.dumps({"label": NAMES[n % 3], "w": 24}).encode()})
                n += 1
        if s == 1:  # one sample with no image: left out and listed
            with open(root / f"train-{s:06d}.tar", "rb") as f:
                data = f.read()
            _append_without_image(root / f"train-{s:06d}.tar", data)
    return root


def _append_without_image(path: Path, existing: bytes) -> None:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(existing)) as old, tarfile.open(fileobj=buf, mode="w") as new:
        for m in old.getmembers():
            new.addfile(m, old.extractfile(m))
        info = tarfile.TarInfo("noimage.cls")
        info.size = 1
        new.addfile(info, io.BytesIO(b"1"))
    path.write_bytes(buf.getvalue())


def test_brace_notation():
    assert expand_braces("a-{000..002}.tar") == ["a-000.tar", "a-001.tar", "a-002.tar"]
    assert expand_braces("{x,y}-{8..9}") == ["x-8", "x-9", "y-8", "y-9"]
    assert split_url("s3://b/p/train-{0..1}.tar") == ("s3://b/p", ["train-0.tar", "train-1.tar"])
    assert split_url("/data/shards/") == ("/data/shards", None)
    with pytest.raises(ValueError, match="one folder"):
        split_url("/data/{a,b}/x.tar")
    with pytest.raises(ValueError, match="LOW <= HIGH"):
        expand_braces("{9..1}")


def _all_labels(url: str) -> dict[str, int]:
    s = ShardStream(url, batch_size=2, resolution=16, train=False, error_budget=0.0)
    out = {}
    for b in s:
        out.update({k: int(v) for k, v, ok in zip(b["key"], b["label"], b["valid"]) if ok})
    assert s.skipped() == {}
    return out


def test_index_beside_the_tars_and_train_on_them(tmp_path):
    root = _tars(tmp_path / "wds")
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    meta = index_shards(str(root))
    assert {p.name: p.read_bytes() for p in root.iterdir() if p.suffix == ".tar"} == before  # not rewritten
    assert meta["splits"]["train"]["samples"] == 12 and meta["num_classes"] == 3
    assert [b["key"] for b in meta["bad_samples"]] == ["noimage"]
    labels = _all_labels(str(root))
    assert labels == {f"{n:09d}": n % 3 for n in range(12)}
    assert verify_dataset(str(root)) == []


@pytest.mark.parametrize("member", ["txt", "json:label"])
def test_labels_from_names_and_a_separate_out(tmp_path, member):
    root, out = _tars(tmp_path / "wds"), tmp_path / "index"
    classes = tmp_path / "classes.txt"
    classes.write_text("owl\ncat\ndog\n")
    code = main(["shards", "index", f"{root}/train-{{000000..000002}}.tar", "--out", str(out),
                 "--label-member", member, "--classes", str(classes)])
    assert code == 0 and not (root / "dataset.json").exists()
    owl_first = {"owl": 0, "cat": 1, "dog": 2}
    assert _all_labels(str(out)) == {f"{n:09d}": owl_first[NAMES[n % 3]] for n in range(12)}
    assert verify_dataset(str(out)) == []


def test_index_on_s3(tmp_path, moto_s3):
    root = _tars(tmp_path / "wds", shards=2)
    storage = open_storage("s3://vitscale-adopt/wds", endpoint_url=moto_s3)
    storage.client.create_bucket(Bucket="vitscale-adopt")
    for p in sorted(root.iterdir()):
        storage.write_file(p.name, p)
    index_shards("s3://vitscale-adopt/wds", endpoint_url=moto_s3)
    assert len(read_index("s3://vitscale-adopt/wds", endpoint_url=moto_s3)) == 8
    s = ShardStream("s3://vitscale-adopt/wds", batch_size=4, resolution=16, train=True, endpoint_url=moto_s3)
    assert sum(int(b["valid"].sum()) for b in s) == 8


def test_bad_label_member_is_one_line(tmp_path, capsys):
    root = _tars(tmp_path / "wds", shards=1)
    assert main(["shards", "index", str(root), "--label-member", "xml"]) == 2
    assert capsys.readouterr().err.strip() == ("vitscale: error: --label-member must be cls, txt, json:KEY or none "
                                               "(images alone), got 'xml'")


def _image_tars(root: Path, shards: int = 2, per: int = 5, labelled_from: int | None = None) -> Path:
    """Tars of images alone (no .cls/.txt/.json member), as a crawl of unlabelled images writes them; from
    shard `labelled_from` on, with .cls members too."""
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with wds.TarWriter(str(root / f"train-{s:06d}.tar")) as tw:
            for i in range(per):
                sample = {"__key__": f"{s}-{i:04d}", "jpg": _image(s * per + i, "JPEG")}
                if labelled_from is not None and s >= labelled_from:
                    sample["cls"] = b"1"
                tw.write(sample)
    return root


def test_tars_without_label_members_index_as_images_without_labels(tmp_path, capsys):
    root = _image_tars(tmp_path / "crawl")
    assert main(["shards", "index", str(root)]) == 0
    out = capsys.readouterr().out
    assert "no sample has a .cls label member" in out and "masked_patch" in out
    meta = json.loads((root / "dataset.json").read_text())
    assert (meta["num_classes"], meta["classes"], meta["label_member"], meta["bad_samples"]) == (0, [], "none", [])
    assert meta["splits"]["train"]["samples"] == 10 and verify_dataset(str(root)) == []
    stream = ShardStream(str(root), batch_size=5, resolution=16, train=False, error_budget=0.0)
    assert sum(int(b["valid"].sum()) for b in stream) == 10 and stream.skipped() == {}


def test_label_member_none_ignores_labels_and_cls_requires_them(tmp_path):
    root = _image_tars(tmp_path / "mixed", labelled_from=1)  # the first tar has none: the default is images alone
    meta = index_shards(str(root), out=str(tmp_path / "default"), progress=False)
    assert meta["num_classes"] == 0 and meta["splits"]["train"]["samples"] == 10
    labelled = _tars(tmp_path / "wds", shards=1)
    meta = index_shards(str(labelled), out=str(tmp_path / "none"), label_member="none", progress=False)
    assert meta["num_classes"] == 0 and meta["splits"]["train"]["samples"] == 4  # labels there, not read
    with pytest.raises(Exception, match="no sample with an image and a .cls label"):
        index_shards(str(_image_tars(tmp_path / "crawl")), out=str(tmp_path / "cls"), label_member="cls",
                     max_bad=None, progress=False)


def _flip_a_pixel_byte(tar: Path, key: str) -> None:
    """Change one byte inside ``key``'s image data, keeping the tar's headers (and so the index) valid."""
    import tarfile

    with tarfile.open(tar) as t:
        m = next(m for m in t.getmembers() if m.name.startswith(key) and m.name.endswith((".jpg", ".png", ".webp")))
    data = bytearray(tar.read_bytes())
    data[m.offset_data + m.size // 2] ^= 0xFF
    tar.write_bytes(bytes(data))


def test_adopted_samples_carry_checksums_and_corruption_is_caught(tmp_path):
    root = _tars(tmp_path / "wds", shards=2)
    index_shards(str(root))
    table = read_index(str(root))
    assert (np.asarray(table["crc32"]) >= 0).all()
    # A JPEG with a flipped entropy-coded byte still decodes (to wrong pixels): only the checksum sees it.
    _flip_a_pixel_byte(root / "train-000000.tar", "000000003")
    s = ShardStream(str(root), batch_size=2, resolution=16, train=False, error_budget=1.0)
    keys = {k for b in s for k, ok in zip(b["key"], b["valid"]) if ok}
    assert keys == {f"{n:09d}" for n in range(8)} - {"000000003"}
    assert s.skipped() == {"train-000000.tar": 1}


def test_no_checksums_reads_headers_only(tmp_path):
    root = _tars(tmp_path / "wds", shards=1)
    assert main(["shards", "index", str(root), "--no-checksums"]) == 0
    assert (np.asarray(read_index(str(root))["crc32"]) == -1).all()


# ------------------------------------------------------------------------ which split a tar's name says


@pytest.mark.parametrize(("name", "split"), [
    ("train-000000.tar", "train"), ("test-000000.tar", "test"), ("TEST-000001.tar", "TEST"),
    ("imagenet1k-train-0000.tar", "train"), ("imagenet1k-validation-00.tar", "validation"),  # timm's HF layout
    ("test_000000.tar", "test"), ("val.000000.tar", "val"), ("imagenet-test-000000.tar", "test"),
    ("imagenet_train-000.tar", "train"), ("train-00000-of-01024.tar", "train"), ("dev-3.tar", "dev"),
    ("val.tar", "val"), ("val/00000.tar", "val"), ("train/cc3m-000000.tar", "train"), ("x-val-test-0.tar", "test"),
    ("cc3m-000000.tar", "cc3m"), ("my_split-000000.tar", "my_split"),  # WebDataset's {split}-NNNNNN.tar
    ("00000.tar", None), ("laion-data-00000.tar", None), ("imagenet1k.tar", None), ("contest-00.tar", "contest"),
    ("pretrained_00001.tar", None), ("trainer.00001.tar", None),
])
def test_the_split_a_tar_name_says(name: str, split: str | None) -> None:
    assert split_of_shard(name) == split
    assert split is None or SPLIT_NAME.fullmatch(split)  # a name the rest of vitscale takes as a split


def _labelled_tar(path: Path, n: int, label: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as tw:
        for i in range(n):
            tw.write({"__key__": f"{path.stem.replace('.', '_')}-{i:04d}", "jpg": _image(i, "JPEG"),
                      "cls": str(label).encode()})


@pytest.mark.parametrize(("tars", "samples"), [
    ({"imagenet1k-train-0000.tar": 5, "imagenet1k-train-0001.tar": 4, "imagenet1k-validation-00.tar": 3},
     {"train": 9, "validation": 3}),
    ({"train_000000.tar": 4, "test_000000.tar": 2}, {"train": 4, "test": 2}),
    ({"train.000000.tar": 4, "val.000000.tar": 2}, {"train": 4, "val": 2}),
    ({"imagenet-train-000000.tar": 4, "imagenet-test-000000.tar": 2}, {"train": 4, "test": 2}),
    ({"train-00000-of-00002.tar": 3, "train-00001-of-00002.tar": 3, "val-00000-of-00001.tar": 2},
     {"train": 6, "val": 2}),
    ({"train/00000.tar": 4, "val/00000.tar": 2}, {"train": 4, "val": 2}),
    ({"train-000000.tar": 4, "TEST-000001.tar": 2}, {"TEST": 2, "train": 4}),
])
def test_index_keeps_each_split_the_names_say(tmp_path: Path, capsys: pytest.CaptureFixture, tars: dict[str, int],
                                              samples: dict[str, int]) -> None:
    root = tmp_path / "wds"
    for name, n in tars.items():
        _labelled_tar(root / name, n, 1)
    assert main(["shards", "index", str(root), "--out", str(tmp_path / "idx")]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == samples
    meta = read_meta(str(tmp_path / "idx"))
    for split in samples:  # each split opens as training and evaluation open it, its own shards only
        assert {s.rpartition("/")[2] for s in open_dataset(str(tmp_path / "idx"), split).shard_names} == {
            name.rpartition("/")[2] for name in tars if split_of_shard(name) == split}
        assert meta.split(split).samples == samples[split]


def test_tars_that_say_a_split_beside_tars_that_say_none_are_refused(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "wds"
    _labelled_tar(root / "00000.tar", 4, 0)
    _labelled_tar(root / "00001.tar", 4, 1)
    _labelled_tar(root / "test_000000.tar", 2, 1)
    for extra in ([], ["--split", "train"]):  # never one merged split, asked for or not
        assert main(["shards", "index", str(root), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "test_000000.tar" in err and "00000.tar" in err and "--split NAME" in err
        assert not (root / "dataset.json").exists()
    # What the line says to do: each split's tars on their own, the split named.
    assert main(["shards", "index", str(root / "0000{0,1}.tar"), "--split", "train", "--out", str(tmp_path / "tr")]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == {"train": 8}
    assert main(["shards", "index", str(root / "test_000000.tar"), "--out", str(tmp_path / "te")]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == {"test": 2}
    assert main(["shards", "index", str(root / "test_000000.tar"), "--split", "a-b", "--out", str(tmp_path / "x")]) == 2
    assert "--split 'a-b': a split name is letters, digits and '_'" in capsys.readouterr().err


# ------------------------------------------------------------------ crawled tars: captions are not labels


def _crawl_tars(root: Path, shards: int = 2, per: int = 4) -> Path:
    """img2dataset's output: N.jpg, N.json (the URL and its metadata), N.txt (the caption)."""
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with wds.TarWriter(str(root / f"{s:05d}.tar")) as tw:
            for i in range(per):
                n = s * per + i
                meta = {"url": f"https://example.com/{n}.jpg", "key": f"{n:09d}", "status": "success",
                        "caption": f"a photo of thing {n}", "width": 24, "height": 20}
                tw.write({"__key__": f"{n:09d}", "jpg": _image(n, "JPEG"), "json": json.dumps(meta).encode(),
                          "txt": f"a photo of thing {n} on a sunny day".encode()})
    return root


def test_crawled_tars_index_as_images_without_labels(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = _crawl_tars(tmp_path / "crawl")
    assert main(["shards", "index", str(root), "--out", str(tmp_path / "idx")]) == 0
    out = capsys.readouterr().out
    assert "no sample has a .cls label member" in out and "--label-member txt" in out and "json:KEY" in out
    meta = read_meta(str(tmp_path / "idx"))
    assert (meta.num_classes, meta.split("train").samples, meta.extra["bad_samples"]) == (0, 8, [])
    # Labels required where there are none: one line that says how to index the images alone.
    assert main(["shards", "index", str(root), "--label-member", "cls", "--out", str(tmp_path / "cls")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no sample with an image and a .cls label" in err
    assert "--label-member none" in err and "masked_patch" in err
    assert main(["shards", "index", str(root), "--label-member", "cls", "--max-bad", "3",
                 "--out", str(tmp_path / "cls")]) == 2
    assert "more than 3 bad samples" in (err := capsys.readouterr().err) and "--label-member none" in err


def test_vitscale_multi_label_json_members_are_labels_unasked(tmp_path: Path) -> None:
    root = tmp_path / "multi"
    root.mkdir()
    with wds.TarWriter(str(root / "train-000000.tar")) as tw:
        for i in range(4):  # the contract's multi-label member, beside img2dataset-style metadata that is not one
            tw.write({"__key__": f"{i:04d}", "jpg": _image(i, "JPEG"), "txt": b"a caption",
                      "json": json.dumps({"labels": [i % 3, 3], "url": "https://example.com"}).encode()})
    meta = index_shards(str(root), progress=False)
    assert (meta["label_member"], meta["num_classes"], meta["multi_label"]) == ("json:labels", 4, True)


def test_the_shards_of_a_write_that_never_finished_are_not_indexed(tmp_path: Path, capsys: pytest.CaptureFixture
                                                                    ) -> None:
    from vitscale.data.tools.publish import WRITING

    half = _tars(tmp_path / "half", shards=2)
    (half / WRITING).write_text("{}")  # what a `shards write` killed after its first shards leaves
    for argv in ([str(half)], [str(_tars(tmp_path / "whole", shards=1)), "--out", str(half)]):
        assert main(["shards", "index", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vitscale: error: ") and err.count("\n") == 1 and WRITING in err, err
        assert not (half / "dataset.json").exists() and not (half / "_index.parquet").exists()


def test_indexing_again_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tars = _tars(tmp_path / "tars", shards=1)
    assert main(["shards", "index", str(tars)]) == 0
    capsys.readouterr()
    assert main(["shards", "index", str(tars)]) == 2
    err = capsys.readouterr().err
    assert "is already a dataset; index into another --out, or delete its dataset.json" in err and err.count("\n") == 1


def _gzip_tar(path: Path, tar: Path) -> Path:
    import gzip

    path.write_bytes(gzip.compress(tar.read_bytes()))
    return path


@pytest.mark.parametrize("where", ["beside", "alone", "named", "braces", "gzip-as-tar"])
def test_a_gzip_compressed_tar_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture, where: str) -> None:
    """WebDataset streams .tar.gz shards; vitscale reads samples by byte range. A folder's .tar.gz were left out of
    the listing without a word (a dataset short of their samples), one named was 'no tar shard (*.tar)', and gzip
    bytes under a .tar name 'not a readable tar: invalid header'."""
    root = _tars(tmp_path / "wds", shards=2)
    gz = root / ("train-000001.tar" if where == "gzip-as-tar" else "train-000001.tar.gz")
    plain = tmp_path / "plain.tar"
    plain.write_bytes((root / "train-000001.tar").read_bytes())
    (root / "train-000001.tar").unlink()
    _gzip_tar(gz, plain)
    if where == "alone":
        (root / "train-000000.tar").unlink()
    url = {"named": str(gz), "braces": f"{root}/train-{{000001..000001}}.tar.gz"}.get(where, str(root))
    assert main(["shards", "index", url]) == 2
    err = capsys.readouterr().err
    assert err == (f"vitscale: error: {gz} is a gzip-compressed tar: vitscale reads each sample by its byte range, "
                   "which needs uncompressed shards; decompress them (gunzip) and index the .tar files\n"), err
    assert not (root / "dataset.json").exists()


@pytest.mark.parametrize("order", ["by-extension", "shuffled"])
def test_a_tar_whose_samples_members_are_apart_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                     order: str) -> None:
    """`tar cf x.tar *.jpg *.cls`, or a folder tarred in directory order: each member was a sample of its own, and
    the index ended on 'more than 100 bad samples ... no readable .cls label member; --label-member none indexes
    the images without labels', advice that drops labels the tar has."""
    import random
    import tarfile

    files = [(f"{i:05d}.{ext}", data) for i in range(120)
             for ext, data in (("jpg", _image(i, "JPEG")), ("cls", str(i % 3).encode()))]
    files = sorted(files, key=lambda f: f[0].split(".")[1]) if order == "by-extension" else \
        random.Random(0).sample(files, len(files))
    root = tmp_path / "tars"
    root.mkdir()
    with tarfile.open(root / "train-0.tar", "w") as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert main(["shards", "index", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vitscale: error: {root / 'train-0.tar'}: the members of sample ") and \
        "are not consecutive (at bytes " in err and "tar --sort=name" in err and err.count("\n") == 1, err
    assert not (root / "dataset.json").exists()


def test_a_key_repeated_whole_is_still_two_samples(tmp_path: Path) -> None:
    """A sample written twice (both with an image) is not a sample split up: each is kept, as before."""
    root = tmp_path / "tars"
    root.mkdir()
    with wds.TarWriter(str(root / "train-0.tar")) as tw:
        for i in (0, 1, 0):
            tw.write({"__key__": f"{i}", "jpg": _image(i, "JPEG"), "cls": b"1"})
    assert index_shards(str(root), progress=False)["splits"]["train"]["samples"] == 3


def test_a_key_written_twice_one_copy_bad_leaves_out_that_copy_alone(tmp_path: Path) -> None:
    """A key written twice in one tar, the first copy's label unreadable: `shards index` keeps the second copy
    and lists the first as bad, with its place in the tar; `verify` leaves out that copy alone and finds
    nothing wrong (it had left out both copies by their key, then counted one sample fewer than the index)."""
    root = tmp_path / "tars"
    root.mkdir()
    with wds.TarWriter(str(root / "train-0.tar")) as tw:
        for key, label in (("0", b"x"), ("1", b"1"), ("0", b"2")):
            tw.write({"__key__": key, "jpg": _image(int(label) if label.isdigit() else 5, "JPEG"), "cls": label})
    info = index_shards(str(root), progress=False)
    assert info["splits"]["train"]["samples"] == 2
    meta = json.loads((root / "dataset.json").read_text())
    [bad] = meta["bad_samples"]
    index = read_index(open_storage(str(root))).to_pylist()
    assert bad["key"] == "0" and bad["offset"] == 0 and [(r["key"], r["labels"]) for r in index] == [("1", [1]),
                                                                                                       ("0", [2])]
    assert verify_dataset(str(root)) == []


def test_a_second_index_of_the_same_place_at_once_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Two `shards index` of one folder at once (the first paused while reading its tars, the second with
    `--split other --label-member none`) both passed the check that no dataset.json was there and both said
    they succeeded; the first to finish lost its dataset to the other's index and dataset.json. The index is
    written under the destination's lease, as `shards write` writes: the other one is refused in one line, by
    the lease while the first writes, or by the first's dataset.json once it has finished."""
    import os

    from vitscale.data.storage.lease import LeaseHeld
    from vitscale.data.tools import adopt, publish

    root = _tars(tmp_path / "tars")
    with publish.held(open_storage(str(root))):  # another index (or write) of the folder, writing now
        with pytest.raises(LeaseHeld, match=f"dataset {root} is being written by pid {os.getpid()} "):
            index_shards(str(root), split="other", label_member="none", progress=False)
        assert main(["shards", "index", str(root), "--split", "other"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"vitscale: error: shards index {root}: LeaseHeld: dataset {root} is being written "
                              f"by pid {os.getpid()} ") and "\n" not in err
    assert not (root / "dataset.json").exists() and not (root / "_index.parquet").exists()

    real, other = adopt._samples, []

    def meanwhile(*args, **kwargs):  # while this index reads its first tar, another one runs whole
        if not other:
            other.append("running")
            monkeypatch.setattr(adopt, "_samples", real)
            index_shards(str(root), split="other", label_member="none", progress=False)
        return real(*args, **kwargs)

    monkeypatch.setattr(adopt, "_samples", meanwhile)
    with pytest.raises(ValueError, match=f"{root}/dataset.json exists: {root} became a dataset meanwhile"):
        index_shards(str(root), progress=False)
    assert list(read_meta(open_storage(str(root))).splits) == ["other"]  # the one that finished first, whole
    assert read_meta(open_storage(str(root))).num_classes == 0


def test_tars_not_yet_adopted_are_named_with_the_command_that_adopts_them(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """A pipeline, few-shot probe or `shards` verb pointed at another tool's tars said to write a dataset
    there with `shards write` (which refuses a folder holding shards it did not write): it names `shards index`."""
    from vitscale.config.checks import ConfigError
    from vitscale.eval.config import FewshotConfig
    from vitscale.eval.probe import check_probe_datasets
    from vitscale.stages.datasets import ensure_dataset

    root = _tars(tmp_path / "tars")
    adopt = f"but 3 tar file(s): `vitscale shards index {root}` adopts them where they lie"
    with pytest.raises(ConfigError, match=re.escape(f"data.url: no dataset at {root} (no dataset.json), {adopt}")):
        ensure_dataset(str(root), None, None, "data.url")
    with pytest.raises(FileNotFoundError, match=re.escape(adopt)):
        check_probe_datasets(FewshotConfig(datasets=(str(root),)))
    assert main(["shards", "stats", str(root)]) == 2
    assert adopt in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=re.escape(f"write one with `vitscale shards write --source ... --out {empty}`")):
        ensure_dataset(str(empty), None, None, "data.url")
    assert main(["shards", "index", str(root)]) == 0
    assert ensure_dataset(str(root), None, None, "data.url").samples("train") == 12
