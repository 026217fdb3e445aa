"""`shards index` (and the loader) on tars written to hurt: labels parsed with bounded size and depth,
absurd class ids, non-UTF-8, headers that claim more bytes than the shard holds. Each makes its sample
bad (listed, counted, within --max-bad), never a crash and never an allocation the shard does not hold."""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vitscale.cli import main
from vitscale.data.format import DatasetError, read_index
from vitscale.data.loader.labels import (
    MAX_CLASSES,
    MAX_JSON_DEPTH,
    LabelError,
    check_class_ids,
    json_depth,
    parse_class_id,
    parse_json_label,
    parse_text_label,
)
from vitscale.data.loader.reader import parse_label
from vitscale.data.loader.tar import BadSample
from vitscale.data.tools.adopt import index_shards


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 90, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


JPG = _jpeg()


def _tar(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def _claim_size(path: Path, member: str, size: int) -> None:
    """Rewrite `member`'s header to claim `size` bytes (valid checksum): a header that lies."""
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as tar:
        offset = next(m.offset for m in tar.getmembers() if m.name == member)
    hdr = data[offset:offset + 512]
    hdr[124:136] = f"{size:011o}\0".encode()
    hdr[148:156] = b" " * 8
    hdr[148:156] = f"{sum(hdr):06o}\0 ".encode()
    data[offset:offset + 512] = hdr
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- the label parser


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_label_error(data: bytes) -> None:
    for parse in (parse_class_id, parse_text_label, lambda d: parse_json_label(d, "label")):
        with contextlib.suppress(LabelError):
            parse(data)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=30))
def test_json_depth_is_the_nesting(value: object) -> None:
    def depth(v: object) -> int:
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

    assert json_depth(json.dumps(value)) == depth(value)
    assert json_depth(json.dumps({"k": value, "s": "[[[{{{\\\"["})) == 1 + depth(value)  # brackets in strings


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(10**18) + 1, max_value=10**18 - 1), st.sampled_from(["", " ", "\n", "+"]))
def test_class_ids_round_trip(value: int, pad: str) -> None:
    text = (pad.strip() if value >= 0 else "") + str(value) + pad.replace("+", "")
    assert parse_class_id(text.encode()) == value


@pytest.mark.parametrize("data", [b"9" * 1_000_000, b"9" * 19, b"1e9", b"0x10", b"\xff\xfe", b"", b"--1", "٣".encode()])
def test_absurd_cls_labels_are_label_errors(data: bytes) -> None:
    with pytest.raises(LabelError, match="malformed .cls"):
        parse_class_id(data)


@pytest.mark.parametrize("data", [b"[" * 100_000, b'{"label": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"1" + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
                                  b'{"label": 1', b"\xc3\x28", b'{"label": ' + b"9" * 5000 + b"}", b'{"other": 1}',
                                  b'{"label": 1.5}', b'{"label": [true]}', b'{"label": {"a": 1}}'])
def test_absurd_json_labels_are_label_errors(data: bytes) -> None:
    with pytest.raises(LabelError):
        parse_json_label(data, "label")


def test_class_ids_are_checked_against_the_count() -> None:
    check_class_ids([0, 2], 3)
    for ids, count in (([3], 3), ([-1], 3), ([MAX_CLASSES], None), ([-5], None)):
        with pytest.raises(LabelError, match="outside"):
            check_class_ids(ids, count)


def test_the_training_loader_uses_the_same_bounded_parser() -> None:
    for members in ({"cls": b"9" * 1_000_000}, {"cls": b"-1"}, {"json": b"[" * 100_000},
                    {"json": b'{"labels": [1, "dog"]}'}, {"cls": b"\xff"}):
        with pytest.raises(BadSample):
            parse_label(members, num_classes=10, multi_label=True)
    assert parse_label({"json": b'{"labels": [1, 3]}'}, num_classes=10, multi_label=True) == [1, 3]


# ----------------------------------------------------------------------------- shards index


GOOD = [(f"good{i}", {"jpg": JPG, "cls": str(i % 3).encode()}) for i in range(4)]


def test_hostile_labels_are_bad_samples_not_crashes(tmp_path: Path) -> None:
    hostile = [
        ("huge_digits", {"jpg": JPG, "cls": b"9" * 200_000}),  # once: a 3.5 GB class table, MemoryError
        ("absurd_id", {"jpg": JPG, "cls": b"999999999"}),
        ("negative", {"jpg": JPG, "cls": b"-1"}),
        ("not_utf8", {"jpg": JPG, "cls": b"\xff\xfe1"}),
        ("empty", {"jpg": JPG, "cls": b""}),
    ]
    _tar(tmp_path / "wds" / "train-000000.tar", GOOD[:2] + hostile + GOOD[2:])
    meta = index_shards(str(tmp_path / "wds"))
    assert sorted(b["key"] for b in meta["bad_samples"]) == sorted(k for k, _ in hostile)
    assert meta["num_classes"] == 3 and meta["splits"]["train"]["samples"] == 4
    assert sorted(read_index(str(tmp_path / "wds"))["key"].to_pylist()) == [k for k, _ in GOOD]


def test_deep_json_and_out_of_range_ids_against_num_classes(tmp_path: Path) -> None:
    samples = [(f"s{i}", {"jpg": JPG, "json": json.dumps({"label": i % 3}).encode()}) for i in range(3)]
    samples += [("deep", {"jpg": JPG, "json": b'{"label": ' + b"[" * 5000 + b"]" * 5000 + b"}"}),
                ("too_big_id", {"jpg": JPG, "json": b'{"label": 7}'}),
                ("bad_name", {"jpg": JPG, "json": b'{"label": [1, 2.5]}'})]
    _tar(tmp_path / "wds" / "train-000000.tar", samples)
    meta = index_shards(str(tmp_path / "wds"), label_member="json:label", num_classes=5, out=str(tmp_path / "idx"))
    errors = {b["key"]: b["error"] for b in meta["bad_samples"]}
    assert set(errors) == {"deep", "too_big_id", "bad_name"}
    assert "nested deeper" in errors["deep"] and "outside [0, 5)" in errors["too_big_id"]
    assert meta["num_classes"] == 5 and meta["splits"]["train"]["samples"] == 3


def test_a_header_claiming_gigabytes_costs_no_memory(tmp_path: Path) -> None:
    shard = _tar(tmp_path / "wds" / "train-000000.tar", [*GOOD, ("liar", {"jpg": JPG, "cls": b"1"})])
    _claim_size(shard, "liar.cls", 8 * 2**30 - 1)  # 8 GiB claimed in a shard of a few kB
    tracemalloc.start()
    try:
        meta = index_shards(str(tmp_path / "wds"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, peak
    assert [b["key"] for b in meta["bad_samples"]] == ["liar"] and "past the end of the shard" in meta["bad_samples"][0]["error"]
    assert meta["splits"]["train"]["samples"] == 4


def test_a_header_claiming_more_than_the_shard_mid_shard(tmp_path: Path) -> None:
    shard = _tar(tmp_path / "wds" / "train-000000.tar", [*GOOD[:2], ("liar", {"jpg": JPG, "cls": b"1"}), *GOOD[2:]])
    _claim_size(shard, "liar.jpg", 2**33 - 1)
    meta = index_shards(str(tmp_path / "wds"))
    assert meta["splits"]["train"]["samples"] == 2  # the samples before it; the walk cannot go past it
    assert "liar" in {b["key"] for b in meta["bad_samples"]}


def test_more_bad_samples_than_max_bad_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _tar(tmp_path / "wds" / "train-000000.tar",
         GOOD + [(f"bad{i}", {"jpg": JPG, "cls": b"x" * (i + 1)}) for i in range(3)])
    with pytest.raises(DatasetError, match="more than 2 bad samples"):
        index_shards(str(tmp_path / "wds"), max_bad=2)
    assert main(["shards", "index", str(tmp_path / "wds"), "--max-bad", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad2" in err and "Traceback" not in err, err
    assert main(["shards", "index", str(tmp_path / "wds"), "--max-bad", "3", "--num-classes", "3"]) == 0
