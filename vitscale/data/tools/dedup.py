"""Remove near-duplicates of test images from a training set (the ViT paper de-duplicated its
pre-training data against the downstream test sets): ``vitscale shards dedup``.

Every image of both sides is hashed, every training image within ``threshold`` bits of a test image's
hash is found (:mod:`vitscale.data.tools.near_duplicates`: the pHash and its exact search), and the
training set is copied without them, beside the pairs found and a summary.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

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
from vitscale.data.tools.near_duplicates import DEFAULT_THRESHOLD, band_layout, near_duplicate_pairs, phash
from vitscale.data.tools.progress import Progress
from vitscale.data.tools.scan import ShardSample, iter_shard, labels_of
from vitscale.data.tools.write import ShardWriter

__all__ = ["dedup_dataset", "hash_dataset"]

_OF_THE_SOURCE_SHARDS = (SHARD_ROOT, "bad_samples")
"""``dataset.json`` entries about the training set's own shards, which its copy does not keep."""

PAIRS_NAME = "dedup_pairs.parquet"
SUMMARY_NAME = "dedup_summary.json"


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
