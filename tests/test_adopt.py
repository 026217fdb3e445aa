"""`vitscale shards index`: WebDataset tars written by others train like a vitscale dataset."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from vitscale.cli import main
from vitscale.data.format import read_index
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
    assert "no sample has a label member" in out and "masked_patch" in out
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
