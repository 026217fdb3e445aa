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
from vitscale.data.tools.dedup import (
    DEFAULT_THRESHOLD,
    PAIRS_NAME,
    SUMMARY_NAME,
    band_layout,
    dedup_dataset,
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
