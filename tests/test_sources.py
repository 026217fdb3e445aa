"""Image sources: folder, image list, digits, synthetic."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vitscale.data.tools.digits import DigitsSource
from vitscale.data.tools.image_list import parse_labels
from vitscale.data.tools.keys import unique_keys as _unique_keys
from vitscale.data.tools.sources import image_of, open_source
from vitscale.data.tools.synthetic import SyntheticSource, class_pattern


def _png(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (20, 12)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def test_folder_source_imagenet_layout(tmp_path: Path) -> None:
    _png(tmp_path / "zebra" / "a.png", (0, 0, 0))
    _png(tmp_path / "zebra" / "nested" / "a.PNG", (1, 1, 1))
    _png(tmp_path / "ant" / "a.png", (2, 2, 2))
    (tmp_path / "ant" / "notes.txt").write_text("not an image")
    (tmp_path / ".hidden").mkdir()
    src = open_source(f"folder:{tmp_path}")
    assert src.classes == ("ant", "zebra") and not src.multi_label and len(src) == 3
    samples = list(src)
    assert [s.labels for s in samples] == [(0,), (1,), (1,)]
    keys = [s.key for s in samples]
    assert len(set(keys)) == 3 and all(re.fullmatch(r"[A-Za-z0-9_-]+", k) for k in keys)
    assert image_of(samples[0].image).getpixel((0, 0)) == (2, 2, 2)


def test_a_dataset_is_never_written_into_the_folder_its_source_reads(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from vitscale.cli import main

    src = tmp_path / "photos"
    for name in ("cat", "dog"):
        _png(src / name / "a.png", (0, 0, 0))
    for out in (src / "shards", src, src / "cat" / "x"):  # a class folder more, or shards among the images
        assert main(["shards", "write", "--source", f"folder:{src}/", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"vitscale: error: {out}: the folder the source") and err.count("\n") == 1, err
    assert sorted(p.name for p in src.rglob("*")) == ["a.png", "a.png", "cat", "dog"]  # nothing written there
    assert open_source(f"folder:{src}").classes == ("cat", "dog")
    assert main(["shards", "write", "--source", f"folder:{src}", "--out", str(tmp_path / "photos-shards")]) == 0


def test_folder_source_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        open_source(f"folder:{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="no images .* one sub-folder of images per class .* or images alone"):
        open_source(f"folder:{tmp_path}")
    (tmp_path / "cls").mkdir()
    with pytest.raises(ValueError, match="no images"):
        open_source(f"folder:{tmp_path}")


def test_a_broken_link_is_an_unreadable_file_not_left_out(tmp_path: Path) -> None:
    """It was skipped without a word: the dataset one image short, nothing in bad_files."""
    from vitscale.data.tools.write import write_dataset

    _png(tmp_path / "src" / "cat" / "a.png", (1, 2, 3))
    (tmp_path / "src" / "cat" / "moved.png").symlink_to(tmp_path / "elsewhere" / "moved.png")
    assert len(open_source(f"folder:{tmp_path / 'src'}")) == 2
    meta = write_dataset(f"folder:{tmp_path / 'src'}", str(tmp_path / "ds"), progress=False)
    assert [b["file"] for b in meta["bad_files"]] == [str(tmp_path / "src" / "cat" / "moved.png")]


@given(st.lists(st.text(min_size=0, max_size=12), max_size=30))
def test_unique_keys_are_safe_and_unique(raw: list[str]) -> None:
    keys = _unique_keys(raw)
    assert len(keys) == len(raw) and len(set(keys)) == len(keys)
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", k) for k in keys)


def test_parse_labels_forms() -> None:
    assert parse_labels(3) == ["3"]
    assert parse_labels(4.0) == ["4"]
    assert parse_labels("3;17") == ["3", "17"]
    assert parse_labels("[3, 17]") == ["3", "17"]
    assert parse_labels([5, "cat"]) == ["5", "cat"]
    assert parse_labels(np.array([1, 2])) == ["1", "2"]
    assert parse_labels(None) == []
    with pytest.raises(ValueError, match="not an integer"):
        parse_labels(2.5)


def test_image_list_csv_multilabel_strings(tmp_path: Path) -> None:
    for i in range(3):
        _png(tmp_path / "img" / f"{i}.png", (i, i, i))
    (tmp_path / "m.csv").write_text("image_path,labels\nimg/0.png,3;17\nimg/1.png,2\nimg/2.png,17\n")
    src = open_source(f"list:{tmp_path / 'm.csv'}")
    assert src.multi_label and len(src.classes) == 18
    assert [s.labels for s in src] == [(3, 17), (2,), (17,)]
    assert image_of(src[1].image).getpixel((0, 0)) == (1, 1, 1)


def test_image_list_parquet_names_and_lists(tmp_path: Path) -> None:
    for i in range(3):
        _png(tmp_path / f"{i}.png", (i, 0, 0))
    table = pa.table({
        "path": [str(tmp_path / f"{i}.png") for i in range(3)],
        "class": [["dog"], ["cat"], ["dog"]],
        "key": ["x.0", "x.1", "x.2"],
    })
    pq.write_table(table, tmp_path / "m.parquet")
    src = open_source(f"list:{tmp_path / 'm.parquet'}")
    assert src.classes == ("cat", "dog") and not src.multi_label
    assert [s.labels for s in src] == [(1,), (0,), (1,)]
    assert [s.key for s in src] == ["x_0", "x_1", "x_2"]  # dots would break WebDataset keys
    src2 = open_source(f"list:{tmp_path / 'm.parquet'}", classes=["dog", "cat", "bird"])
    assert [s.labels for s in src2] == [(0,), (1,), (0,)]


def test_a_damaged_parquet_image_list_is_one_error_naming_it(tmp_path: Path) -> None:
    from vitscale.config.errors import UserError

    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"path": ["a.png"] * 50, "label": ["dog"] * 50}), whole)
    for name, data in (("text.parquet", b"path,label\na.png,dog\n"), ("cut.parquet", whole.read_bytes()[:-20])):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError, match=rf"^image list {re.escape(str(tmp_path / name))}: cannot read it as parquet"):
            open_source(f"list:{tmp_path / name}")


def test_image_list_errors_name_the_problem(tmp_path: Path) -> None:
    (tmp_path / "m.csv").write_text("picture,label\na.png,1\n")
    with pytest.raises(ValueError, match=r"missing image path column; name one of \['path'"):
        open_source(f"list:{tmp_path / 'm.csv'}")
    with pytest.raises(ValueError, match="missing label column 'y'"):
        open_source(f"list:{tmp_path / 'm.csv'}", path_column="picture", label_column="y")
    src = open_source(f"list:{tmp_path / 'm.csv'}", path_column="picture")
    with pytest.raises(ValueError, match="a.png does not exist"):
        src[0]
    (tmp_path / "n.csv").write_text("path,label\na.png,5\n")
    with pytest.raises(ValueError, match=r"label 5 outside \[0, 2\)"):
        open_source(f"list:{tmp_path / 'n.csv'}", classes=["a", "b"])


def test_a_spreadsheets_csv_reads_and_a_binary_one_is_one_error(tmp_path: Path) -> None:
    """Excel's "CSV UTF-8" starts with a byte-order mark: it glued itself to the first column's name
    ("missing image path column"). A file that is not UTF-8 was a UnicodeDecodeError traceback."""
    from vitscale.config.errors import UserError

    _png(tmp_path / "a.png", (1, 2, 3))
    (tmp_path / "excel.csv").write_bytes(b"\xef\xbb\xbfpath,label\r\na.png,dog\r\n")
    assert open_source(f"list:{tmp_path / 'excel.csv'}").classes == ("dog",)
    (tmp_path / "utf16.csv").write_bytes("path,label\na.png,dog\n".encode("utf-16"))
    with pytest.raises(UserError, match=rf"^image list {re.escape(str(tmp_path / 'utf16.csv'))}: cannot read it as "
                                        "UTF-8 CSV"):
        open_source(f"list:{tmp_path / 'utf16.csv'}")


def test_a_mistyped_huge_class_id_is_an_error_not_every_class_below_it(tmp_path: Path) -> None:
    """Without classes= the count is the largest id + 1: a 20-digit id built a name for every class below it
    until the process was killed for memory."""
    (tmp_path / "m.csv").write_text("path,label\na.png,1\nb.png,99999999999999999999\n")
    with pytest.raises(ValueError, match=r"label 99999999999999999999 outside \[0, 1048576\); more than 1048576 "
                                         "classes need classes= naming them"):
        open_source(f"list:{tmp_path / 'm.csv'}")


def test_open_source_validates() -> None:
    with pytest.raises(ValueError, match="unknown source"):
        open_source("jft300m")
    with pytest.raises(ValueError, match=r"does not take option\(s\) \['count'\]"):
        open_source("digits", count=3)
    with pytest.raises(ValueError, match="needs a path"):
        open_source("folder:")
    with pytest.raises(ValueError, match=r"synthetic.classes: must be in \[2, 100000\]"):
        SyntheticSource(classes=1)
    with pytest.raises(ValueError, match=r"synthetic.classes: must be in \[2, 100000\]"):
        SyntheticSource(classes=10**9)  # a name each: it ran out of memory before the first image


def test_digits_bundled() -> None:
    src = open_source("digits")
    assert len(src) == 1797 and src.classes == tuple("0123456789")
    s = src[10]
    assert isinstance(s.image, Image.Image) and s.image.size == (64, 64) and s.image.mode == "RGB"
    labels = np.array([src[i].labels[0] for i in range(0, 1797, 7)])
    assert set(labels.tolist()) == set(range(10))
    near = DigitsSource(image_size=16, resample="nearest")[10].image
    # Nearest upscaling of 8x8 by 2 leaves 2x2 blocks of equal pixels.
    a = np.asarray(near)
    assert (a[0::2, 0::2] == a[1::2, 1::2]).all()


def test_synthetic_deterministic_and_photo_sized() -> None:
    a, b = SyntheticSource(count=6, seed=3), SyntheticSource(count=6, seed=3)
    for i in range(6):
        assert np.array_equal(np.asarray(a[i].image), np.asarray(b[i].image))
        assert a[i].key == b[i].key and a[i].labels == b[i].labels
        w, h = a[i].image.size
        assert 256 <= w <= 512 and 256 <= h <= 512
    c = SyntheticSource(count=6, seed=4)
    assert not np.array_equal(np.asarray(a[0].image), np.asarray(c[0].image))
    assert a[0].key != c[0].key  # different seeds make different keys: sets can be merged
    assert [s.labels for s in a] == [(i % 10,) for i in range(6)]


def test_synthetic_multilabel() -> None:
    src = SyntheticSource(count=40, classes=6, image_size=32, multi_label=True)
    assert src.multi_label
    for s in src:
        assert 1 <= len(s.labels) <= 3 and list(s.labels) == sorted(set(s.labels))
        assert all(0 <= c < 6 for c in s.labels) and s.image.size == (32, 32)


@settings(max_examples=30)
@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_class_patterns_are_distinct(a: int, b: int) -> None:
    pa_, pb = class_pattern(a % 50), class_pattern(b % 50)
    if a % 50 != b % 50:
        assert pa_ != pb
    assert 0 <= pa_.hue < 1 and 0 <= pa_.angle < np.pi and pa_.shape in (0, 1, 2)


def test_synthetic_is_learnable_by_a_tiny_vit() -> None:
    """Train on seed 0, test on seed 1: a 2-layer ViT on 32 px beats 10-class chance by far."""
    torch.manual_seed(0)

    def load(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = SyntheticSource(count=n, classes=10, image_size=32, seed=seed)
        x = np.stack([np.asarray(s.image) for s in src])  # (N, 32, 32, 3) uint8
        y = [s.labels[0] for s in src]
        return (torch.tensor(x).permute(0, 3, 1, 2).float() / 255.0 - 0.5) / 0.25, torch.tensor(y)

    xtr, ytr = load(0, 600)
    xte, yte = load(1, 200)
    d, p = 48, 4
    embed = torch.nn.Conv2d(3, d, p, p)  # (N, d, 8, 8) patch tokens
    layer = torch.nn.TransformerEncoderLayer(d, 4, 2 * d, 0.0, batch_first=True, norm_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    pos = torch.nn.Parameter(torch.randn(1, 64, d) * 0.02)
    head = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 10))
    params = [*embed.parameters(), *encoder.parameters(), pos, *head.parameters()]

    def forward(x: torch.Tensor) -> torch.Tensor:
        z = embed(x).flatten(2).transpose(1, 2) + pos  # (N, 64, d)
        return head(encoder(z).mean(1))  # GAP classifier, (N, 10)

    opt = torch.optim.AdamW(params, 2e-3, weight_decay=0.05)
    for _ in range(6):
        for b in torch.randperm(len(xtr)).split(50):
            loss = torch.nn.functional.cross_entropy(forward(xtr[b]), ytr[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        acc = (forward(xte).argmax(1) == yte).float().mean().item()
    assert acc > 0.6, acc  # chance is 0.1; typically ~0.95


def test_image_of_bytes() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (5, 4), (9, 9, 9)).save(buf, "PNG")
    assert image_of(buf.getvalue()).size == (5, 4)
