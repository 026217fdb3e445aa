"""Near-duplicate removal: pHash, banded search (== brute force), and planted duplicates end to end."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

from vitscale.data.format import read_index, read_meta
from vitscale.data.storage import open_storage
from vitscale.data.tools.dedup import PAIRS_NAME, SUMMARY_NAME, dedup_dataset
from vitscale.data.tools.near_duplicates import (
    DEFAULT_THRESHOLD,
    band_layout,
    hamming,
    near_duplicate_pairs,
    phash,
    phash_pixels,
)
from vitscale.data.tools.verify import verify_dataset
from vitscale.data.tools.write import write_dataset


def _brute(q: np.ndarray, x: np.ndarray, t: int) -> set[tuple[int, int, int]]:
    d = hamming(q[:, None], x[None, :])
    return {(i, j, int(d[i, j])) for i, j in zip(*np.nonzero(d <= t))}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=60),
    st.lists(st.tuples(st.integers(0, 59), st.lists(st.integers(0, 63), max_size=14)), max_size=20),
    st.lists(st.integers(0, 2**64 - 1), max_size=10),
    st.integers(0, 20),
)
@example(index=[5, 2**63 + 5, 7], planted=[(0, []), (1, [63])], extra=[4], threshold=0)  # 64-bit band
@example(index=[5, 2**40 + 5], planted=[(0, [1, 50])], extra=[], threshold=2)  # 32-bit bands
def test_banded_search_equals_brute_force(
    index: list[int], planted: list[tuple[int, list[int]]], extra: list[int], threshold: int
) -> None:
    x = np.array(index, dtype=np.uint64)
    queries = list(extra)
    for j, flips in planted:  # near copies of index entries: some within threshold, some not
        if index:
            queries.append(index[j % len(index)] ^ sum(1 << b for b in set(flips)))
    q = np.array(queries, dtype=np.uint64)
    qi, ij, dist = near_duplicate_pairs(q, x, threshold)
    assert set(zip(qi.tolist(), ij.tolist(), dist.tolist())) == (_brute(q, x, threshold) if len(q) and len(x) else set())
    assert len(set(zip(qi.tolist(), ij.tolist()))) == len(qi)  # each pair once


@given(st.integers(1, 10**7), st.integers(0, 32), st.integers(1, 10**6))
def test_band_layout_pigeonhole(n: int, threshold: int, n_queries: int) -> None:
    layout = band_layout(n, threshold, n_queries)
    m = len(layout.widths)
    assert sum(layout.widths) == 64 and max(layout.widths) - min(layout.widths) <= 1
    # Pigeonhole: T bits spread over m bands leave one band with <= T // m differing bits.
    assert layout.radius == threshold // m and 1 <= m <= threshold + 1
    assert layout.shifts[-1] == 0


def test_layout_prefers_wide_bands_for_big_sets() -> None:
    assert len(band_layout(10, 8).widths) == 9  # small: exact-band lookups
    assert len(band_layout(10**8, 8).widths) < 9  # big: wider bands with ball probes


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.2, 3.0), st.floats(-50, 50))
def test_phash_ignores_brightness_and_contrast(seed: int, scale: float, shift: float) -> None:
    # DCT is linear: a*x + b scales every AC coefficient by a > 0 (order kept) and moves only the
    # DC one. If DC crosses the median it swaps places with one neighbour: at most 2 bits move.
    grey = np.random.default_rng(seed).uniform(0, 255, size=(32, 32))
    assert hamming(np.uint64(phash_pixels(grey)), np.uint64(phash_pixels(grey * scale + shift))) <= 2
    assert phash_pixels(grey) == phash_pixels(grey * scale)


def test_phash_rejects_wrong_shape() -> None:
    with pytest.raises(ValueError, match="32, 32"):
        phash_pixels(np.zeros((8, 8)))


def test_a_photo_with_damaged_exif_is_hashed_without_pils_warning() -> None:
    """An adopted tar's .jpg whose EXIF block points past its end: PIL warns "Corrupt EXIF data" on opening
    it; `shards dedup` hashes it with only its own progress bar on the terminal."""
    import warnings

    bad_exif = b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x01\x00\x12\x01\x03\x00\x01\x00\x00\x00\xff\xff\xff\xff"
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 140, 30)).save(buf, "JPEG", exif=bad_exif)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        phash(buf.getvalue())
    assert [str(w.message) for w in seen] == []


def _photo(rng: np.random.Generator, h: int = 240, w: int = 320) -> Image.Image:
    """A photo-like image: 1/f^1.2 coloured noise (natural images have roughly this spectrum)."""
    fy, fx = np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :]
    f = np.hypot(fx, fy)
    f[0, 0] = 1.0
    chans = []
    for _ in range(3):
        spec = (rng.normal(size=f.shape) + 1j * rng.normal(size=f.shape)) / f**1.2
        spec[0, 0] = 0
        chans.append(np.fft.irfft2(spec, s=(h, w)))
    x = np.stack(chans, -1)  # (H, W, 3)
    x = (x - x.mean()) / x.std() * 0.18 + 0.5
    return Image.fromarray((np.clip(x, 0, 1) * 255).astype(np.uint8))


def _save(img: Image.Image, path: Path, quality: int = 90) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, "JPEG", quality=quality)


def _crop(img: Image.Image, frac: float) -> Image.Image:
    w, h = img.size
    dx, dy = int(frac * w), int(frac * h)
    return img.crop((dx, dy, w - dx, h - dy))


def test_planted_duplicates_removed(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    train_imgs = [_photo(rng) for _ in range(40)]
    for i, img in enumerate(train_imgs):
        _save(img, tmp_path / "train_src" / f"c{i % 2}" / f"t{i:02d}.jpg")
    # Test set: 12 unrelated images plus altered copies of 4 training images.
    planted = {
        3: train_imgs[3].resize((160, 120), Image.Resampling.BICUBIC),  # resized
        8: train_imgs[8],  # re-encoded at low quality (below)
        15: _crop(train_imgs[15], 0.02),  # slightly cropped
        22: _crop(train_imgs[22], 0.02).resize((200, 150), Image.Resampling.BILINEAR),  # all of it
    }
    for i in range(12):
        _save(_photo(rng), tmp_path / "test_src" / f"c{i % 2}" / f"new{i:02d}.jpg")
    for i, img in planted.items():
        _save(img, tmp_path / "test_src" / f"c{i % 2}" / f"copy{i:02d}.jpg", quality=40)
    train, test, out = (str(tmp_path / n) for n in ("train", "test", "out"))
    write_dataset(f"folder:{tmp_path / 'train_src'}", train, shard_size=16,
                  splits={"train": 0.75, "minival": 0.25}, progress=False)
    write_dataset(f"folder:{tmp_path / 'test_src'}", test, progress=False)

    summary = dedup_dataset(train, [test], out, progress=False)

    pairs = pq.read_table(io.BytesIO(open_storage(out).read_bytes(PAIRS_NAME))).to_pylist()
    expected_train = {f"c{i % 2}_t{i:02d}" for i in planted}
    assert {p["train_key"] for p in pairs} == expected_train, pairs
    assert {p["against_key"] for p in pairs} == {f"c{i % 2}_copy{i:02d}" for i in planted}
    assert all(p["distance"] <= DEFAULT_THRESHOLD for p in pairs)
    assert summary["removed_total"] == 4 and summary["duplicate_pairs"] == 4
    assert json.loads(open_storage(out).read_bytes(SUMMARY_NAME)) == summary

    new = read_meta(out)
    kept = set(read_index(out).column("key").to_pylist())
    assert kept == set(read_index(train).column("key").to_pylist()) - expected_train
    assert sum(new.samples(s) for s in new.splits) == 36
    assert sum(summary["kept"].values()) == 36 and new.extra["dedup"]["removed_total"] == 4
    assert verify_dataset(out) == []

    with pytest.raises(ValueError, match="already holds a dataset"):
        dedup_dataset(train, [test], out, progress=False)


def test_phash_separates_distinct_photos() -> None:
    rng = np.random.default_rng(1)
    hashes = np.array([phash(_photo(rng, 96, 128)) for _ in range(60)], dtype=np.uint64)
    d = hamming(hashes[:, None], hashes[None, :])[np.triu_indices(60, 1)]
    assert d.min() > DEFAULT_THRESHOLD and 26 < d.mean() < 38  # independent bits differ ~32


def _damage_shard(root: Path, how: str) -> None:
    """Damage train-000000.tar of a written dataset (its size kept, so only reading it tells)."""
    tar = root / "train-000000.tar"
    rows = [r for r in read_index(str(root)).to_pylist() if r["shard"] == tar.name]
    raw = bytearray(tar.read_bytes())
    second = rows[1]["offset"]
    if how == "header":  # a garbled tar header: Python's streaming tar reader takes it for the archive's end
        raw[second : second + 100] = b"\xff" * 100
    elif how == "image":  # the second sample's JPEG bytes, its header intact
        raw[second + 512 : second + 1024] = b"\xab" * 512
    elif how == "label":
        member = next(i for i in range(second, second + rows[1]["size"], 512) if raw[i : i + 100].rstrip(b"\0")
                      .endswith(b".cls"))
        raw[member + 512 : member + 513] = b"x"
    tar.write_bytes(bytes(raw))


_HEADER, _IMAGE = r"train-000000.tar: 1 samples read, dataset.json says 4", r"sample '.*': corrupt image"


@pytest.mark.parametrize(("side", "how", "says"), [
    ("train", "header", _HEADER), ("train", "image", _IMAGE), ("train", "label", r"sample '.*': malformed .cls label"),
    # The datasets dedup against give images only: their labels are never read.
    ("against", "header", _HEADER), ("against", "image", _IMAGE),
])
def test_a_damaged_dataset_is_named_not_copied_short(tmp_path: Path, how: str, says: str, side: str) -> None:
    """A shard read short was copied short without a word (its samples neither kept nor counted as removed),
    and a corrupt image or label was a traceback."""
    from vitscale.data.format import DatasetError

    rng = np.random.default_rng(0)
    clean, damaged = tmp_path / "clean", tmp_path / "damaged"
    for root in (clean, damaged):  # distinct photos: no sample is a duplicate, each is read
        for i in range(8):
            _save(_photo(rng, 64, 80), tmp_path / f"{root.name}_src" / f"c{i % 2}" / f"t{i}.jpg")
        write_dataset(f"folder:{tmp_path / f'{root.name}_src'}", str(root), shard_size=4, progress=False)
    _damage_shard(damaged, how)
    train, against = (damaged, clean) if side == "train" else (clean, damaged)
    with pytest.raises(DatasetError, match=f"{damaged}.*{says}.*shards verify"):
        dedup_dataset(str(train), [str(against)], str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def _peer_tar(path: Path, samples: list[tuple[str, Image.Image, dict[str, bytes]]], image: str, fmt: str) -> None:
    """A tar another tool wrote: each sample's image as member `image` (in PIL format `fmt`), plus `extra`."""
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, img, extra in samples:
            buf = io.BytesIO()
            img.save(buf, fmt)
            for ext, data in ((image, buf.getvalue()), *extra.items()):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _copy_of(img: Image.Image) -> Image.Image:
    return _crop(img, 0.02).resize((72, 56), Image.Resampling.BICUBIC)


def test_keys_that_repeat_across_shards_and_splits_remove_only_the_duplicate(tmp_path: Path) -> None:
    """Tars written apart often number their samples from 0 each (`shards index` adopts them so): a duplicate
    of the test set was removed by its key alone, and with it every other sample of that key, in every shard and
    split (3 removed for 1 pair here). A sample is its shard and byte offset."""
    from vitscale.data.tools.adopt import index_shards

    rng = np.random.default_rng(3)
    photos = [_photo(rng, 64, 80) for _ in range(9)]
    labelled = [{"cls": str(i % 2).encode()} for i in range(9)]
    train = tmp_path / "train"
    for shard, part in (("train-000000.tar", [0, 1, 2]), ("train-000001.tar", [3, 4, 5]), ("test-000000.tar", [6, 7, 8])):
        _peer_tar(train / shard, [(f"{j:06d}", photos[i], labelled[i]) for j, i in enumerate(part)], "jpg", "JPEG")
    _peer_tar(tmp_path / "against" / "test-000000.tar", [("copy", _copy_of(photos[4]), {"cls": b"0"})], "jpg", "JPEG")
    for root in (train, tmp_path / "against"):
        index_shards(str(root), progress=False)
    assert verify_dataset(str(train)) == []  # a key repeated in other shards is no damage

    summary = dedup_dataset(str(train), [str(tmp_path / "against")], str(tmp_path / "out"), progress=False)

    assert summary["duplicate_pairs"] == 1 and summary["removed"] == {"train": 1, "test": 0}, summary
    pairs = pq.read_table(io.BytesIO(open_storage(str(tmp_path / "out")).read_bytes(PAIRS_NAME))).to_pylist()
    assert [(p["train_shard"], p["train_key"]) for p in pairs] == [("train-000001.tar", "000001")]
    kept = [(r["shard"], r["key"]) for r in read_index(str(tmp_path / "out")).to_pylist()]
    assert len(kept) == 8 and sorted(k for _, k in kept).count("000001") == 2  # train-000000's and test's
    assert verify_dataset(str(tmp_path / "out")) == []


@pytest.mark.parametrize(("image", "fmt", "label"), [("png", "PNG", "cls"), ("webp", "WEBP", "cls"),
                                                      ("JPEG", "JPEG", "CLS"), ("jpeg", "JPEG", "txt"),
                                                      ("png", "PNG", "none")])
def test_an_adopted_dataset_of_any_image_member_is_verified_and_deduplicated(
        tmp_path: Path, image: str, fmt: str, label: str) -> None:
    """The loader reads a sample's image from .jpg, .jpeg, .png or .webp, in any case, and `shards index`
    adopts them all; `shards dedup` refused every such dataset ("has no .jpg", on either side), and `shards
    verify` called every sample of upper-case members bad. The copy keeps each image as it was, with the
    labels the dataset has (in the index, for class names; none, for images alone)."""
    from vitscale.data.loader.stream import ShardStream
    from vitscale.data.tools.adopt import index_shards

    rng = np.random.default_rng(4)
    photos = [_photo(rng, 64, 80) for _ in range(6)]
    names = (b"cat", b"dog")
    train, against, out = tmp_path / "train", tmp_path / "against", tmp_path / "out"
    _peer_tar(train / "train-000000.tar",
              [(f"s{i}", photos[i], {label: names[i % 2] if label == "txt" else str(i % 2).encode()} if label != "none"
                else {}) for i in range(6)], image, fmt)
    _peer_tar(against / "test-000000.tar", [("t0", _copy_of(photos[2]), {})], image, fmt)
    index_shards(str(train), label_member=label.lower(), progress=False)
    index_shards(str(against), label_member="none", progress=False)
    assert verify_dataset(str(train)) == [] and verify_dataset(str(against)) == []

    summary = dedup_dataset(str(train), [str(against)], str(out), progress=False)

    assert summary["removed"] == {"train": 1}, summary
    rows = read_index(str(out)).to_pylist()
    assert [r["key"] for r in rows] == ["s0", "s1", "s3", "s4", "s5"]
    labels = [[], [], [], [], []] if label == "none" else [[0], [1], [1], [0], [1]]
    assert [r["labels"] for r in rows] == labels
    assert verify_dataset(str(out)) == []
    import tarfile

    with tarfile.open(out / rows[0]["shard"]) as tar:
        members = tar.getnames()
    assert f"s0.{image.lower()}" in members, members  # the image as it was, not re-encoded
    batch = next(iter(ShardStream(str(out), "train", batch_size=5, resolution=32, train=False)))
    assert bool(batch["valid"].all()) and (label == "none" or batch["label"].tolist() == [0, 1, 1, 0, 1])


def test_a_dataset_indexed_apart_from_its_tars_is_deduplicated(tmp_path: Path) -> None:
    """`shards index TARS --out DEST` leaves the tars where they lie (`shard_root`): dedup looked for them beside
    the index ("No such file or directory"), on either side, where training, stats and verify find them."""
    from vitscale.data.tools.adopt import index_shards

    rng = np.random.default_rng(5)
    photos = [_photo(rng, 64, 80) for _ in range(4)]
    _peer_tar(tmp_path / "tars" / "train-000000.tar", [(f"s{i}", photos[i], {"cls": b"0"}) for i in range(4)],
              "jpg", "JPEG")
    _peer_tar(tmp_path / "test_tars" / "test-000000.tar", [("t0", _copy_of(photos[1]), {})], "jpg", "JPEG")
    train, against = tmp_path / "train_index", tmp_path / "test_index"
    index_shards(str(tmp_path / "tars"), out=str(train), progress=False)
    index_shards(str(tmp_path / "test_tars"), out=str(against), label_member="none", progress=False)

    summary = dedup_dataset(str(train), [str(against)], str(tmp_path / "out"), progress=False)

    assert summary["removed"] == {"train": 1} and summary["kept"] == {"train": 3}, summary
    assert verify_dataset(str(tmp_path / "out")) == []
