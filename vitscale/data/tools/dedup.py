"""Remove near-duplicates of test images from a training set (the ViT paper de-duplicated its
pre-training data against the downstream test sets): ``vitscale shards dedup``.

Each image gets a 64-bit DCT perceptual hash (pHash, our own numpy implementation rather than
the ``imagehash`` package: grey, 32x32, 2-D DCT-II, the 8x8 lowest frequencies thresholded at their
median). Two images are near-duplicates when their hashes differ in at most ``threshold`` bits.

Search is a multi-index hash, not an all-pairs scan: the 64 bits are cut into ``m`` bands; if two
hashes are within ``T`` bits, some band differs in at most ``T // m`` bits (pigeonhole). Each band
of the training hashes is sorted once; every query band is probed with all bit flips of weight
``<= T // m`` by binary search, and only the candidates this yields are compared in full. ``m`` (the
:class:`BandLayout`) is chosen by a cost model (probes x expected bucket size). The result is
exact, same as brute force.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from vitscale.config.checks import check
from vitscale.data.format import (
    LABEL_SOURCE,
    META_NAME,
    SHARD_ROOT,
    DatasetError,
    SplitMeta,
    read_index,
    read_meta,
    shard_storage,
    write_index_and_meta,
)
from vitscale.data.loader.reader import no_label
from vitscale.data.loader.sample import image_member, no_image
from vitscale.data.storage import Storage, open_storage
from vitscale.data.tools import publish
from vitscale.data.tools.images import pil_quiet
from vitscale.data.tools.progress import Progress
from vitscale.data.tools.scan import ShardSample, iter_shard, labels_of
from vitscale.data.tools.write import ShardWriter

__all__ = [
    "DEFAULT_THRESHOLD",
    "BandLayout",
    "band_layout",
    "dedup_dataset",
    "hamming",
    "hash_dataset",
    "near_duplicate_pairs",
    "phash",
    "phash_pixels",
]

DEFAULT_THRESHOLD = 10
"""Bits (of 64): catches resized, re-encoded and slightly cropped copies; distinct images sit
around 32 bits apart, and a pair below 16 is rare (see tests/test_dedup.py)."""

_OF_THE_SOURCE_SHARDS = (SHARD_ROOT, "bad_samples")
"""``dataset.json`` entries about the training set's own shards, which its copy does not keep."""

PAIRS_NAME = "dedup_pairs.parquet"
SUMMARY_NAME = "dedup_summary.json"
_HASH_SIDE = 32  # DCT input side
_LOW = 8  # low-frequency block side: 8x8 = 64 bits


@lru_cache(maxsize=4)
def _dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II matrix (n, n): ``C @ x`` is the DCT of column vector ``x``."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    c = np.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    c[0] /= math.sqrt(2.0)
    return c


def phash_pixels(grey: np.ndarray) -> int:
    """pHash of a (32, 32) grey image array: 64 bits, row-major over the 8x8 low frequencies."""
    if grey.shape != (_HASH_SIDE, _HASH_SIDE):
        raise ValueError(f"phash_pixels needs a ({_HASH_SIDE}, {_HASH_SIDE}) array, got {grey.shape}")
    c = _dct_matrix(_HASH_SIDE)
    coeffs = c @ grey.astype(np.float64) @ c.T  # (32, 32) 2-D DCT-II
    low = coeffs[:_LOW, :_LOW]  # (8, 8), DC included (as imagehash's phash does)
    bits = (low > np.median(low)).ravel()  # (64,)
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def phash(image: Image.Image | bytes) -> int:
    """64-bit pHash of a PIL image or encoded image bytes."""
    with pil_quiet():  # an adopted tar's photo with damaged EXIF: its hash, not PIL's warning mid-bar
        img = image if isinstance(image, Image.Image) else Image.open(io.BytesIO(image))
    if img.format == "JPEG":
        img.draft("L", (2 * _HASH_SIDE, 2 * _HASH_SIDE))  # let libjpeg decode at reduced scale
    grey = img.convert("L").resize((_HASH_SIDE, _HASH_SIDE), Image.Resampling.LANCZOS)
    return phash_pixels(np.asarray(grey, dtype=np.float64))


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bitwise Hamming distance of uint64 arrays (broadcasting)."""
    return np.bitwise_count(np.asarray(a, np.uint64) ^ np.asarray(b, np.uint64)).astype(np.int64)


@dataclass(frozen=True)
class BandLayout:
    """How the 64 bits are cut for the multi-index search."""

    widths: tuple[int, ...]
    """Bits per band, summing to 64, most significant band first."""
    radius: int
    """Bit flips probed per band: ``threshold // len(widths)``."""

    @property
    def shifts(self) -> tuple[int, ...]:
        """Right shift that brings each band to the low bits."""
        ends = np.cumsum(self.widths)
        return tuple(int(64 - e) for e in ends)


def _band_widths(m: int) -> tuple[int, ...]:
    return tuple(64 // m + (1 if j < 64 % m else 0) for j in range(m))


_TABLE_MAX_BITS = 24  # bands up to this wide get a dense bucket table (2^w int64 entries)


def band_layout(n_index: int, threshold: int, n_queries: int | None = None) -> BandLayout:
    """Pick the band count with the least estimated work for the multi-index search.

    Pure function. Work = queries x probes x (lookup + expected bucket size) + table building.
    ``threshold + 1`` bands make every probe exact (radius 0) but narrow bands mean big buckets
    on large sets; fewer, wider bands need Hamming-ball probes and give tiny buckets.
    """
    check(0 <= threshold < 64, "threshold", f"must be in [0, 63] bits, got {threshold}")
    n_q = n_index if n_queries is None else n_queries
    best: tuple[float, BandLayout] | None = None
    for m in range(1, min(threshold + 1, 64) + 1):
        widths = _band_widths(m)
        r = threshold // m
        probes = sum(sum(math.comb(w, k) for k in range(r + 1)) for w in widths)
        table = max(widths) <= _TABLE_MAX_BITS
        lookup = 1.0 if table else math.log2(n_index + 2)
        build = sum(2.0**w for w in widths) if table else m * n_index * math.log2(n_index + 2)
        cost = n_q * probes * (lookup + n_index / 2.0 ** min(widths)) + build
        if best is None or cost < best[0]:
            best = (cost, BandLayout(widths, r))
    if best is None:  # unreachable: the loop runs at least once (m = 1)
        raise RuntimeError("band_layout found no layout")
    return best[1]


def _flip_masks(width: int, radius: int) -> np.ndarray:
    """All ``width``-bit masks with at most ``radius`` bits set, (P,) uint64."""
    masks = [0]
    for k in range(1, radius + 1):
        masks += [sum(1 << b for b in bits) for bits in itertools.combinations(range(width), k)]
    return np.array(masks, dtype=np.uint64)


def near_duplicate_pairs(
    queries: np.ndarray, index: np.ndarray, threshold: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (query i, index j) with ``hamming(queries[i], index[j]) <= threshold``.

    Returns ``(qi, ij, dist)`` int64 arrays sorted by (qi, ij); exactly the brute-force answer.
    """
    q = np.asarray(queries, dtype=np.uint64)
    x = np.asarray(index, dtype=np.uint64)
    empty = (np.zeros(0, np.int64),) * 3
    if len(q) == 0 or len(x) == 0:
        return empty
    layout = band_layout(len(x), threshold, len(q))
    found: list[np.ndarray] = []
    for width, shift in zip(layout.widths, layout.shifts):
        band_mask = np.uint64((1 << width) - 1)
        xb = (x >> np.uint64(shift)) & band_mask  # (N,) band values
        order = np.argsort(xb, kind="stable")
        qb = (q >> np.uint64(shift)) & band_mask  # (Q,)
        if width <= _TABLE_MAX_BITS:
            # Dense table: bucket v holds order[bucket_at[v]:bucket_at[v + 1]]; O(1) per probe.
            bucket_at = np.zeros((1 << width) + 1, dtype=np.int64)
            np.cumsum(np.bincount(xb.astype(np.int64), minlength=1 << width), out=bucket_at[1:])
        else:
            xs = xb[order]  # sorted band values, probed by binary search
        for flip in _flip_masks(width, layout.radius):
            probe = qb ^ flip
            if width <= _TABLE_MAX_BITS:
                p64 = probe.astype(np.int64)
                lo, hi = bucket_at[p64], bucket_at[p64 + 1]
            else:
                lo, hi = np.searchsorted(xs, probe, "left"), np.searchsorted(xs, probe, "right")
            counts = hi - lo  # (Q,) bucket sizes
            total = int(counts.sum())
            if total == 0:
                continue
            qi = np.repeat(np.arange(len(q)), counts)
            # Positions lo[i] .. hi[i]-1 for every query, concatenated.
            first = np.repeat(lo - np.cumsum(counts) + counts, counts)
            ij = order[first + np.arange(total)]
            keep = hamming(q[qi], x[ij]) <= threshold
            found.append(qi[keep] * len(x) + ij[keep])
    if not found:
        return empty
    flat = np.unique(np.concatenate(found))  # a pair can surface in several bands
    qi, ij = flat // len(x), flat % len(x)
    return qi.astype(np.int64), ij.astype(np.int64), hamming(q[qi], x[ij])


def _iter_samples(url: str, endpoint_url: str | None) -> Iterator[tuple[str, str, ShardSample]]:
    """(split, shard, sample) for every sample of a dataset, in ``dataset.json`` order.

    A damaged shard is a :class:`DatasetError` naming it: Python's streaming tar reader takes a garbled
    header for the end of the archive, so a shard read short (fewer samples than ``dataset.json`` says) was
    copied short, or hashed short, without a word."""
    index = open_storage(url, endpoint_url=endpoint_url)
    meta = read_meta(index)
    storage = shard_storage(index, meta, endpoint_url)  # (shards adopted with `shards index --out` lie elsewhere)
    for split in meta.splits:
        for shard in meta.splits[split].shards:
            n = 0
            try:
                with storage.open_read(shard.name) as f:
                    for s in iter_shard(f):
                        n += 1
                        yield split, shard.name, s
            except tarfile.TarError as exc:
                raise _damaged(storage.url_of(shard.name), url, f"unreadable after {n} samples ({exc})") from exc
            if n < shard.samples:
                raise _damaged(storage.url_of(shard.name), url, f"{n} samples read, {META_NAME} says {shard.samples}")


def _damaged(where: str, url: str, why: str) -> DatasetError:
    return DatasetError(f"{where}: {why}: a damaged dataset (`vitscale shards verify {url}` lists every problem)")


def _hash_sample(url: str, shard: str, s: ShardSample) -> int:
    """The pHash of a sample's image; a missing or undecodable one is a :class:`DatasetError` naming it."""
    ext = image_member(s.files)
    if ext is None:
        raise _damaged(f"{url}: {shard}", url, f"sample {s.key!r}: {no_image(s.files)}")
    try:
        return phash(s.files[ext])
    except Exception as exc:  # any decoder error (PIL raises several kinds) is this image's damage
        raise _damaged(f"{url}: {shard}", url, f"sample {s.key!r}: corrupt image: {type(exc).__name__}: {exc}") from exc


def hash_dataset(url: str, *, endpoint_url: str | None = None, progress: bool = True) -> pa.Table:
    """pHash of every image: table of split, shard, key, phash (uint64)."""
    storage = open_storage(url, endpoint_url=endpoint_url)
    total = sum(sp.samples for sp in read_meta(storage).splits.values())
    cols: dict[str, list[Any]] = {"split": [], "shard": [], "key": [], "offset": [], "phash": []}
    batch: list[tuple[str, str, ShardSample]] = []
    bar = Progress(total, f"hash {storage.url}", unit="img", enabled=progress)
    with ThreadPoolExecutor(max_workers=4) as pool, bar:

        def flush() -> None:
            hashes = list(pool.map(lambda t: _hash_sample(url, t[1], t[2]), batch))  # PIL decodes outside the GIL
            for (split, shard, sample), h in zip(batch, hashes):
                cols["split"].append(split)
                cols["shard"].append(shard)
                cols["key"].append(sample.key)
                cols["offset"].append(sample.offset)
                cols["phash"].append(h)
            bar.update(len(batch))
            batch.clear()

        for split, shard, s in _iter_samples(url, endpoint_url):
            batch.append((split, shard, s))
            if len(batch) >= 256:
                flush()
        flush()
    return pa.table(
        {k: pa.array(v, type=_HASH_TYPES.get(k, pa.string())) for k, v in cols.items()}
    )


_HASH_TYPES = {"offset": pa.int64(), "phash": pa.uint64()}
"""`hash_dataset`'s columns that are not text. A sample is (shard, offset): its key alone may repeat across
shards, splits and even within a shard of an adopted dataset (`shards index` keeps each as its sample)."""


def dedup_dataset(
    train: str,
    against: list[str],
    out: str,
    *,
    threshold: int = DEFAULT_THRESHOLD,
    endpoint_url: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Copy dataset ``train`` to ``out`` without images near-duplicating any image in ``against``.

    Writes at ``out`` a complete dataset (shards, index, ``dataset.json`` with a ``dedup`` entry)
    plus ``dedup_pairs.parquet`` (every pair found) and ``dedup_summary.json``; returns the summary.
    """
    if not against:
        raise ValueError("dedup needs at least one --against dataset")
    band_layout(1, threshold)  # validates the threshold before any work
    out_storage = open_storage(out, endpoint_url=endpoint_url)
    # Claimed, filled, published (data/tools/publish.py): a failed or interrupted dedup leaves no dataset.
    publish.claim(out_storage)
    try:
        summary = _dedup_into(out_storage, train, against, threshold, endpoint_url, progress)
    except BaseException as exc:
        publish.abort(out_storage, exc, also=(PAIRS_NAME, SUMMARY_NAME))
        raise
    publish.release(out_storage)
    return summary


def _dedup_into(out_storage: Storage, train: str, against: list[str], threshold: int, endpoint_url: str | None,
                progress: bool) -> dict[str, Any]:
    """The body of :func:`dedup_dataset` once ``out_storage`` is claimed; returns the summary."""
    train_storage = open_storage(train, endpoint_url=endpoint_url)
    meta, train_index = read_meta(train_storage), read_index(train_storage)
    train_h = hash_dataset(train, endpoint_url=endpoint_url, progress=progress)
    pairs = _pairs(train_h, against, threshold, endpoint_url, progress)
    drop = set(zip(pairs.column("train_shard").to_pylist(), pairs.column("train_offset").to_pylist(), strict=True))

    shard_size = max((sh.samples for sp in meta.splits.values() for sh in sp.shards), default=1)
    rows_of = _index_rows(train_index, labels=meta.extra.get(LABEL_SOURCE) == "index")
    new_splits: dict[str, SplitMeta] = {}
    rows: list[dict[str, Any]] = []
    removed: dict[str, int] = {}
    total = sum(sp.samples for sp in meta.splits.values())
    with Progress(total, f"copy {out_storage.url}", unit="img", enabled=progress) as bar:
        writers = {s: ShardWriter(out_storage, s, shard_size, meta.multi_label) for s in meta.splits}
        try:
            for split, shard, s in _iter_samples(train, endpoint_url):
                bar.update()
                if (shard, s.offset) in drop:
                    removed[split] = removed.get(split, 0) + 1
                    continue
                row = rows_of.get((shard, s.offset), {})
                labels = _copied_labels(train, s, meta.num_classes, row.get("labels"))
                ext = image_member(s.files) or "jpg"  # (hashed above: it has one)
                writers[split].add(s.key, s.files[ext], labels, row.get("width"), row.get("height"), ext=ext)
            for split, wr in writers.items():
                wr.finish_shard()
                new_splits[split] = SplitMeta(len(wr.rows), tuple(wr.shards))
                rows.extend(wr.rows)
        except BaseException as exc:
            for wr in writers.values():
                wr.abort(exc)
            raise
    summary = {
        "train": train_storage.url,
        "against": list(against),
        "out": out_storage.url,
        "hash": "phash-dct-64 (vitscale numpy implementation)",
        "threshold": threshold,
        "train_samples": train_h.num_rows,
        "duplicate_pairs": pairs.num_rows,
        "removed": {s: removed.get(s, 0) for s in meta.splits},
        "removed_total": sum(removed.values()),
        "kept": {s: v.samples for s, v in new_splits.items()},
    }
    buf = io.BytesIO()
    pq.write_table(pairs, buf)
    out_storage.write_bytes(PAIRS_NAME, buf.getvalue())
    out_storage.write_bytes(SUMMARY_NAME, (json.dumps(summary, indent=2) + "\n").encode())
    dedup_note = {k: summary[k] for k in ("train", "against", "threshold", "removed_total")}
    # The copy's shards are its own: not the adopted tars' folder (`shard_root`: its index would place its records
    # in the source's tars), nor the samples `shards index` left out of those (`bad_samples`).
    kept = {k: v for k, v in meta.extra.items() if k not in _OF_THE_SOURCE_SHARDS}
    new_meta = replace(meta, splits=new_splits, extra={**kept, "dedup": dedup_note})
    write_index_and_meta(out_storage, rows, new_meta)
    return summary


def _pairs(train_h: pa.Table, against: list[str], threshold: int, endpoint_url: str | None,
           progress: bool) -> pa.Table:
    """Every near-duplicate pair between the hashed training set ``train_h`` and each dataset of ``against``:
    which training sample, which image of which dataset, at what Hamming distance."""
    x = train_h.column("phash").to_numpy()
    t_split, t_shard, t_key, t_offset = (train_h.column(c).to_pylist() for c in ("split", "shard", "key", "offset"))
    pair_cols: dict[str, list[Any]] = {k: [] for k in (
        "train_split", "train_shard", "train_key", "train_offset", "against", "against_split", "against_key",
        "distance")}
    for url in against:
        q_h = hash_dataset(url, endpoint_url=endpoint_url, progress=progress)
        qi, ij, dist = near_duplicate_pairs(q_h.column("phash").to_numpy(), x, threshold)
        q_split, q_key = q_h.column("split").to_pylist(), q_h.column("key").to_pylist()
        for a, b, d in zip(qi.tolist(), ij.tolist(), dist.tolist()):
            pair_cols["train_split"].append(t_split[b])
            pair_cols["train_shard"].append(t_shard[b])
            pair_cols["train_key"].append(t_key[b])
            pair_cols["train_offset"].append(t_offset[b])
            pair_cols["against"].append(url)
            pair_cols["against_split"].append(q_split[a])
            pair_cols["against_key"].append(q_key[a])
            pair_cols["distance"].append(d)
    return pa.table(pair_cols, schema=pa.schema(
        [(k, _PAIR_TYPES.get(k, pa.string())) for k in pair_cols]))


_PAIR_TYPES = {"train_offset": pa.int64(), "distance": pa.int32()}
"""The pairs' columns that are not text; a training sample is (``train_shard``, ``train_offset``), the byte where
its record starts (its key may repeat: `_HASH_TYPES`)."""


def _index_rows(index: pa.Table, labels: bool) -> dict[tuple[str, int], dict[str, Any]]:
    """The index's rows by (shard, offset), with what the copy keeps of each: its image's size (when the index
    has it: an adopted one has not) and, where the dataset's labels live in the index (`shards index
    --label-member txt` or `json:KEY`), its labels."""
    kept = [c for c in ("width", "height", *(("labels",) if labels else ())) if c in index.column_names]
    return {(r["shard"], r["offset"]): r for r in index.select(["shard", "offset", *kept]).to_pylist()}


def _copied_labels(train: str, s: ShardSample, num_classes: int, indexed: list[int] | None) -> list[int]:
    """The labels of the kept training sample ``s``: the index's (`indexed`) where the dataset's labels live
    there, none for a dataset of images alone, else its label member's, inside the classes. A damaged one stops
    the copy naming it (never a shard copied short, nor a label another class reads)."""
    if num_classes == 0:  # images alone (masked patch pre-training): any label member is not a label
        return []
    try:
        labels = list(indexed) if indexed is not None else labels_of(s)
    except ValueError as exc:  # a hostile label (LabelError)
        raise _damaged(train, train, f"sample {s.key!r}: {exc}") from exc
    if labels is None:
        raise _damaged(train, train, f"sample {s.key!r}: {no_label(s.files)}")
    if num_classes and not all(0 <= x < num_classes for x in labels):
        raise _damaged(train, train, f"sample {s.key!r} has labels {labels} outside [0, {num_classes})")
    return labels
