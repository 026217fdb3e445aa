"""Check and describe a written dataset: ``vitscale shards verify`` and ``vitscale shards stats``.

:func:`verify_dataset` re-hashes every shard and cross-checks counts, keys, labels and byte ranges
between the tars, ``_index.parquet`` and ``dataset.json``; :func:`dataset_stats` summarises a
dataset from its metadata and index without opening a shard.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Set as AbstractSet
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from vitscale.data.format import (
    INDEX_NAME,
    LABEL_SOURCE,
    META_NAME,
    SHARD_ROOT,
    DatasetError,
    ShardMeta,
    check_index_schema,
    read_index,
    read_meta,
    shard_storage,
)
from vitscale.data.loader.labels import LabelError
from vitscale.data.loader.reader import no_label
from vitscale.data.loader.sample import image_member, no_image
from vitscale.data.storage import Storage, open_storage
from vitscale.data.storage.space import size_text
from vitscale.data.tools.progress import Progress
from vitscale.data.tools.scan import iter_shard, labels_of

__all__ = ["dataset_stats", "format_stats", "verify_dataset"]


class _HashingReader(io.RawIOBase):
    """Read-through wrapper that SHA-256s and counts the bytes read."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.f.read(len(b))
        n = len(data)
        b[:n] = data
        self.sha.update(data)
        self.n += n
        return n

    def drain(self) -> None:
        """Read (and hash) whatever the tar reader left: end-of-archive padding."""
        while self.read(1 << 20):
            pass


def verify_dataset(url: str, *, endpoint_url: str | None = None, progress: bool = False) -> list[str]:
    """Re-hash every shard and check counts, keys, labels and byte ranges against ``dataset.json``
    and ``_index.parquet``.

    Returns the problems found, each naming the shard (or file) at fault; an empty list means ok.
    """
    storage = open_storage(url, endpoint_url=endpoint_url)
    try:
        meta, index = read_meta(storage), read_index(storage)
        check_index_schema(index.schema, storage.url_of(INDEX_NAME), labels=meta.extra.get(LABEL_SOURCE) == "index")
    except (OSError, ValueError, pa.ArrowException) as exc:
        return [f"{url}: cannot load {META_NAME}/{INDEX_NAME}: {exc}"]
    problems: list[str] = []
    num_classes = meta.num_classes
    # (shard, key) -> its rows. A key names a sample within its shard, as WebDataset's (url, key) does: tars
    # written apart often number their samples from 0 each, which is no damage (and `shards index` adopts them).
    # A key twice in one shard (written twice; `shards index` keeps each as its sample) is matched by byte range,
    # so the one problem said is the repeat, not a phantom mismatch.
    idx: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in index.to_pylist():
        rows = idx.setdefault((r["shard"], r["key"]), [])
        if len(rows) == 1:
            problems.append(f"{INDEX_NAME}: key {r['key']!r} appears more than once in {r['shard']}")
        rows.append(r)
    listed = {sh.name: (split, sh) for split, sp in meta.splits.items() for sh in sp.shards}
    # A tar beside the shards that dataset.json does not name: a shard a write left, or one copied in by hand.
    # Not where the shards were adopted where they lie and indexed elsewhere (`shards index TARS --out`): that
    # folder is not the dataset's, and the tars the user did not pick there are none of its problems (every
    # verify of such a dataset failed on them).
    if SHARD_ROOT in meta.extra:
        storage = shard_storage(storage, meta, endpoint_url)
    else:
        stray = sorted(n for n in storage.list() if n.endswith(".tar") and n not in listed)
        problems += [f"{n}: shard not listed in {META_NAME}" for n in stray]
    # Adopted shards: samples `shards index` left out (listed), and labels that live in the index.
    # By place in the shard (a key may be there twice, one copy bad); by key where an older index named no place.
    left_out = {(b["shard"], b["offset"] if "offset" in b else b["key"]) for b in meta.extra.get("bad_samples", [])}
    index_labels = meta.extra.get(LABEL_SOURCE) == "index"
    indexed: dict[str, int] = {}
    for rows in idx.values():
        for r in rows:
            indexed[r["shard"]] = indexed.get(r["shard"], 0) + 1
    for name in sorted(set(indexed) - set(listed)):
        problems.append(f"{name}: in {INDEX_NAME} but not in {META_NAME}")
    for split, sp in meta.splits.items():
        if sum(sh.samples for sh in sp.shards) != sp.samples:
            problems.append(
                f"{META_NAME}: split {split!r} says {sp.samples} samples but its shards sum differently"
            )
    with Progress(len(listed), f"verify {storage.url}", unit="shard", enabled=progress) as bar:
        for name, (split, sh) in listed.items():
            problems += _verify_shard(storage, name, split, sh, idx, indexed.get(name, 0), num_classes,
                                      left_out, index_labels)
            bar.update()
    return problems


def _verify_shard(
    storage: Storage, name: str, split: str, sh: ShardMeta, idx: dict[tuple[str, str], list[dict[str, Any]]],
    n_indexed: int, num_classes: int, left_out: AbstractSet[tuple[str, str | int]] = frozenset(),
    index_labels: bool = False,
) -> list[str]:
    problems: list[str] = []
    try:
        f = storage.open_read(name)
    except OSError as exc:
        return [f"{name}: cannot read: {exc}"]
    with f:
        hr = _HashingReader(f)
        count = 0
        try:
            for s in iter_shard(io.BufferedReader(hr, 1 << 20)):
                if (name, s.offset) in left_out or (name, s.key) in left_out:
                    continue
                count += 1
                rows = idx.get((name, s.key), [])
                row = next((r for r in rows if r["offset"] == s.offset), rows[0] if rows else None)
                try:
                    # An unlabelled dataset (num_classes 0) reads no label member: images alone.
                    labels = None if index_labels else [] if num_classes == 0 else labels_of(s)
                except LabelError as exc:  # a hostile label is this sample's problem, not the shard's
                    problems.append(f"{name}: sample {s.key!r}: {exc}")
                    continue
                if image_member(s.files) is None:
                    problems.append(f"{name}: sample {s.key!r}: {no_image(s.files)}")
                if labels is None and not index_labels:
                    problems.append(f"{name}: sample {s.key!r}: {no_label(s.files)}")
                if row is None:
                    problems.append(f"{name}: sample {s.key!r} missing from {INDEX_NAME}")
                    continue
                if (row["offset"], row["size"]) != (s.offset, s.size):
                    problems.append(
                        f"{name}: sample {s.key!r} byte range in index {row['offset']}+{row['size']}"
                        f" != tar {s.offset}+{s.size}"
                    )
                # An index without a labels column (third-party writers may leave it out) has nothing to compare.
                indexed_labels = row.get("labels", labels)
                if labels is not None and labels != (None if indexed_labels is None else list(indexed_labels)):
                    problems.append(f"{name}: sample {s.key!r} labels {labels} != index {row['labels']}")
                if labels and num_classes and not all(0 <= x < num_classes for x in labels):
                    problems.append(f"{name}: sample {s.key!r} label outside [0, {num_classes})")
                if row["split"] != split:
                    problems.append(
                        f"{name}: sample {s.key!r} indexed under split {row['split']!r}, shard is {split!r}"
                    )
            hr.drain()
        except (OSError, tarfile.TarError, ValueError, UnicodeDecodeError) as exc:
            return [*problems, f"{name}: unreadable after {count} samples: {exc}"]
    if sh.sha256 is not None and hr.sha.hexdigest() != sh.sha256:  # adopted shards carry none
        problems.append(
            f"{name}: sha256 mismatch ({META_NAME} {(sh.sha256 or '')[:12]}..., file {hr.sha.hexdigest()[:12]}...)"
        )
    if sh.nbytes is not None and hr.n != sh.nbytes:
        problems.append(f"{name}: {hr.n} bytes, {META_NAME} says {sh.nbytes}")
    if count != sh.samples:
        problems.append(f"{name}: {count} samples in tar, {META_NAME} says {sh.samples}")
    if n_indexed != sh.samples:
        problems.append(f"{name}: {n_indexed} rows in {INDEX_NAME}, {META_NAME} says {sh.samples}")
    return problems


def dataset_stats(url: str, *, endpoint_url: str | None = None) -> dict[str, Any]:
    """Counts of a dataset from its metadata and index: shards, samples, bytes, classes, per split."""
    storage = open_storage(url, endpoint_url=endpoint_url)
    meta, index = read_meta(storage), read_index(storage)
    split_col = index.column("split").to_pylist()
    # Third-party indexes may have no labels column: per-class counts are then unknown (None), not zeros.
    has_labels = "labels" in index.column_names
    label_col = index.column("labels").to_pylist() if has_labels else [[]] * index.num_rows
    splits: dict[str, Any] = {}
    for split, sp in meta.splits.items():
        per_class = np.zeros(meta.num_classes, dtype=np.int64)
        n_indexed = 0
        for row, (s, ls) in enumerate(zip(split_col, label_col)):
            if s == split:
                n_indexed += 1
                # A label outside dataset.json's classes once was an IndexError, or (-1, null) counted silently
                # against another class: the index and dataset.json disagree, said in one line.
                if ls is None or not all(0 <= x < meta.num_classes for x in ls):
                    raise DatasetError(
                        f"{storage.url_of(INDEX_NAME)}: sample {index.column('key')[row].as_py()!r} of "
                        f"{index.column('shard')[row].as_py()} has labels {ls}, outside [0, {meta.num_classes}) of "
                        f"{META_NAME}: a damaged dataset (`vitscale shards verify` lists what else is wrong)")
                per_class[ls] += 1
        splits[split] = {
            "shards": len(sp.shards),
            "samples": sp.samples,
            "indexed_samples": n_indexed,
            "bytes": sum(sh.nbytes or 0 for sh in sp.shards),
            "classes_present": int((per_class > 0).sum()) if has_labels else None,
            "min_per_class": (int(per_class.min()) if len(per_class) else 0) if has_labels else None,
            "max_per_class": (int(per_class.max()) if len(per_class) else 0) if has_labels else None,
        }
    return {
        "url": storage.url,
        "name": meta.name,
        "shards": sum(v["shards"] for v in splits.values()),
        "samples": sum(v["samples"] for v in splits.values()),
        "bytes": sum(v["bytes"] for v in splits.values()),
        "classes": meta.num_classes,
        "multi_label": meta.multi_label,
        "max_side": meta.max_side,
        "quality": meta.quality,
        "splits": splits,
    }


def format_stats(stats: dict[str, Any]) -> str:
    """A human-readable table of :func:`dataset_stats` output (the CLI's default view)."""
    lines = [
        f"{stats['name']}  {stats['url']}",
        f"{stats['samples']} samples in {stats['shards']} shards, {size_text(stats['bytes'])}, "
        f"{stats['classes']} classes{' (multi-label)' if stats['multi_label'] else ''}, "
        f"max side {stats['max_side']} px, JPEG q{stats['quality']}",
        f"{'split':<12}{'shards':>8}{'samples':>10}{'MB':>10}{'classes':>9}{'min/cls':>9}{'max/cls':>9}",
    ]
    for s, v in stats["splits"].items():
        lines.append(
            f"{s:<12}{v['shards']:>8}{v['samples']:>10}{v['bytes'] / 1e6:>10.1f}"
            + "".join(f"{'-' if v[k] is None else v[k]:>9}" for k in ("classes_present", "min_per_class",
                                                                           "max_per_class"))
        )
    return "\n".join(lines)

