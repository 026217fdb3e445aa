"""Write, describe and verify WebDataset shard sets (local folder or ``s3://``).

A dataset folder holds ``{split}-{n:06d}.tar`` shards, ``_index.parquet`` (one row per sample:
split, shard, key, labels, offset, size, width, height; ``offset``/``size`` cover the sample's tar
members incl. headers and padding, so one ranged read fetches a sample) and ``dataset.json``
(names, classes, splits with per-shard sample counts, SHA-256 and bytes). The index and then
``dataset.json`` are written last: a folder with a ``dataset.json`` is complete.

Each sample is ``{key}.jpg`` plus ``{key}.cls`` (ASCII class index) for single-label data or
``{key}.json`` (``{"labels": [...]}``) for multi-label data.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageOps

from vitscale.data.progress import Progress
from vitscale.data.sources import Sample, Source, image_of, open_source
from vitscale.data.storage import Storage, open_storage

__all__ = [
    "INDEX_NAME",
    "META_NAME",
    "INDEX_SCHEMA",
    "Manifest",
    "ShardSample",
    "ShardWriter",
    "assign_splits",
    "dataset_stats",
    "encode_image",
    "ensure_empty_destination",
    "format_stats",
    "iter_shard",
    "labels_of",
    "load_manifest",
    "parse_splits",
    "shard_name",
    "verify_dataset",
    "write_dataset",
    "write_index_and_meta",
]

INDEX_NAME = "_index.parquet"
META_NAME = "dataset.json"
INDEX_SCHEMA = pa.schema(
    [
        ("split", pa.string()),
        ("shard", pa.string()),
        ("key", pa.string()),
        ("labels", pa.list_(pa.int32())),
        ("offset", pa.int64()),
        ("size", pa.int64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
    ]
)


def shard_name(split: str, n: int) -> str:
    """``{split}-{n:06d}.tar``."""
    return f"{split}-{n:06d}.tar"


def parse_splits(text: str) -> dict[str, float]:
    """``"train=0.9,minival=0.1"`` -> ``{"train": 0.9, "minival": 0.1}`` (the CLI's ``--split``)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, frac = part.partition("=")
        if not eq:
            raise ValueError(f"--split item {part!r} must look like name=fraction, e.g. train=0.9")
        try:
            out[name.strip()] = float(frac)
        except ValueError:
            raise ValueError(f"--split {name!r}: fraction {frac!r} is not a number") from None
    _check_splits(out)
    return out


def _check_splits(splits: dict[str, float]) -> None:
    if not splits:
        raise ValueError("splits must name at least one split, e.g. {'train': 1.0}")
    for name, frac in splits.items():
        if not name or not all(c.isalnum() or c in "_" for c in name):
            raise ValueError(f"split name {name!r} must be letters, digits or '_' (it names shard files)")
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"split {name!r}: fraction {frac} must be in (0, 1]")
    if abs(sum(splits.values()) - 1.0) > 1e-6:
        raise ValueError(f"split fractions must sum to 1, got {sum(splits.values()):.6g} ({splits})")


def assign_splits(n: int, splits: dict[str, float], seed: int) -> dict[str, np.ndarray]:
    """Carve ``range(n)`` into splits: a seeded permutation cut by largest-remainder counts.

    Pure function of (n, splits, seed). Each returned array holds source indices in the order they
    are written (shuffled, so shards mix classes); arrays are disjoint and cover ``range(n)``, and
    each split's size is within 1 of ``fraction * n``.
    """
    _check_splits(splits)
    names = list(splits)
    exact = np.array([splits[s] * n for s in names])
    counts = np.floor(exact).astype(np.int64)
    # Hand the leftover samples to the largest fractional parts (ties: first listed split).
    for j in np.argsort(-(exact - counts), kind="stable")[: n - int(counts.sum())]:
        counts[j] += 1
    perm = np.random.default_rng(seed).permutation(n)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return {s: perm[bounds[j] : bounds[j + 1]] for j, s in enumerate(names)}


def encode_image(image: Image.Image | bytes, max_side: int, quality: int) -> tuple[bytes, int, int]:
    """Fit ``image`` within ``max_side`` (never enlarging), convert to RGB, encode JPEG.

    Returns ``(jpeg_bytes, width, height)``.
    """
    img = image_of(image)
    # thumbnail() shrinks in place keeping the aspect ratio, never enlarges, and for JPEG input
    # lets libjpeg decode at 1/2, 1/4 or 1/8 scale first (draft), which is much faster.
    img.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
    img = ImageOps.exif_transpose(img)
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.getchannel("A"))  # transparent -> white, not black
        img = flat
    elif img.mode != "RGB":
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue(), img.width, img.height


class _HashingFile:
    """A write-only file wrapper that SHA-256s and counts what passes through."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def write(self, b: bytes) -> int:
        self.sha.update(b)
        self.n += len(b)
        return self.f.write(b)

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        self.f.flush()


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0  # fixed metadata: reproducible bytes
    return info, io.BytesIO(data)


@dataclass
class ShardWriter:
    """Writes one split's shards to ``storage`` through a local spool file, one shard at a time."""

    storage: Storage
    split: str
    shard_size: int
    multi_label: bool
    shards: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    _tmp: Any = None
    _tar: tarfile.TarFile | None = None
    _hf: _HashingFile | None = None
    _count: int = 0

    def add(self, key: str, jpeg: bytes, labels: Sequence[int], width: int, height: int) -> None:
        """Append one sample; starts/finishes shards as they fill."""
        if self._tar is None:
            self._open()
        if self._tar is None or self._hf is None:
            raise RuntimeError("ShardWriter: shard failed to open")
        start = self._tar.offset
        self._tar.addfile(*_member(f"{key}.jpg", jpeg))
        if self.multi_label:
            self._tar.addfile(*_member(f"{key}.json", json.dumps({"labels": list(labels)}).encode()))
        else:
            self._tar.addfile(*_member(f"{key}.cls", str(labels[0]).encode("ascii")))
        name = shard_name(self.split, len(self.shards))
        self.rows.append(
            dict(split=self.split, shard=name, key=key, labels=list(labels), offset=start,
                 size=self._tar.offset - start, width=width, height=height)
        )
        self._count += 1
        if self._count >= self.shard_size:
            self.finish_shard()

    def _open(self) -> None:
        self._tmp = tempfile.NamedTemporaryFile(prefix="vitscale-shard-", suffix=".tar", delete=False)
        self._hf = _HashingFile(self._tmp)
        self._tar = tarfile.open(
            fileobj=self._hf, mode="w", format=tarfile.PAX_FORMAT  # type: ignore[arg-type]
        )
        self._count = 0

    def finish_shard(self) -> None:
        """Close the open shard (if any), upload it and record its entry."""
        if self._tar is None:
            return
        if self._hf is None:
            raise RuntimeError("ShardWriter: shard state lost")
        self._tar.close()
        self._tmp.close()
        name = shard_name(self.split, len(self.shards))
        try:
            self.storage.write_file(name, self._tmp.name)
        finally:
            os.unlink(self._tmp.name)
        self.shards.append(
            {"name": name, "samples": self._count, "sha256": self._hf.sha.hexdigest(), "bytes": self._hf.n}
        )
        self._tar = self._hf = self._tmp = None

    def abort(self) -> None:
        """Drop the open shard's spool file after an error."""
        if self._tmp is not None:
            self._tmp.close()
            os.unlink(self._tmp.name)
            self._tar = self._hf = self._tmp = None


def ensure_empty_destination(storage: Storage) -> None:
    """Refuse to write over an existing dataset (stale shards would linger and mislead)."""
    existing = [n for n in storage.list() if n == META_NAME or n.endswith(".tar") or n == INDEX_NAME]
    if existing:
        raise ValueError(
            f"{storage.url} already holds a dataset ({existing[0]}); write to a new --out or delete it first"
        )


def write_index_and_meta(storage: Storage, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write ``_index.parquet`` then ``dataset.json`` (last: its presence marks a complete set)."""
    table = pa.Table.from_pylist(rows, schema=INDEX_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    storage.write_bytes(INDEX_NAME, buf.getvalue())
    storage.write_bytes(META_NAME, (json.dumps(meta, indent=2) + "\n").encode())


def _encoded_in_order(
    source: Source,
    order: np.ndarray,
    encode: Callable[[Sample], tuple[Sample, bytes, int, int]],
    workers: int,
) -> Iterator[tuple[Sample, bytes, int, int]]:
    """Encode samples on a thread pool (PIL releases the GIL) while keeping write order."""
    window = max(4, 4 * workers)  # bounded in-flight work: memory stays flat on big sets
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: list[Any] = []
        for i in order:
            pending.append(pool.submit(lambda j=int(i): encode(source[j])))
            if len(pending) >= window:
                yield pending.pop(0).result()
        for fut in pending:
            yield fut.result()


def write_dataset(
    source: str,
    out: str,
    *,
    shard_size: int = 1000,
    max_side: int = 384,
    quality: int = 90,
    seed: int = 0,
    splits: dict[str, float] | None = None,
    source_options: dict[str, Any] | None = None,
    name: str | None = None,
    endpoint_url: str | None = None,
    progress: bool = True,
    workers: int | None = None,
) -> dict[str, Any]:
    """Write ``source`` (see :func:`vitscale.data.sources.open_source`) as shards at ``out``.

    Images are shrunk to fit ``max_side`` (never enlarged) and JPEG-encoded at ``quality``;
    samples are shuffled and carved into ``splits`` (default ``{"train": 1.0}``) from ``seed``.
    ``seed`` also seeds the synthetic source unless ``source_options`` sets its own. Returns the
    ``dataset.json`` content.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if max_side < 8:
        raise ValueError(f"max_side must be >= 8 px, got {max_side}")
    if not 1 <= quality <= 95:
        raise ValueError(f"quality must be in [1, 95] (JPEG), got {quality}")
    splits = dict(splits) if splits else {"train": 1.0}
    opts = dict(source_options or {})
    if source.partition(":")[0] == "synthetic":
        opts.setdefault("seed", seed)
    src = open_source(source, **opts)
    storage = open_storage(out, endpoint_url=endpoint_url)
    ensure_empty_destination(storage)
    plan = assign_splits(len(src), splits, seed)
    n_workers = workers or min(8, os.cpu_count() or 1)

    def encode(s: Sample) -> tuple[Sample, bytes, int, int]:
        return (s, *encode_image(s.image, max_side, quality))

    meta_splits: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    with Progress(len(src), f"write {storage.url}", unit="img", enabled=progress) as bar:
        for split, order in plan.items():
            writer = ShardWriter(storage, split, shard_size, src.multi_label)
            try:
                for sample, jpeg, w, h in _encoded_in_order(src, order, encode, n_workers):
                    if sample.key in seen:
                        raise ValueError(
                            f"{source}: duplicate sample key {sample.key!r}; keys must be unique"
                        )
                    seen.add(sample.key)
                    writer.add(sample.key, jpeg, sample.labels, w, h)
                    bar.update()
                writer.finish_shard()
            except BaseException:
                writer.abort()
                raise
            meta_splits[split] = {"samples": len(order), "shards": writer.shards}
            rows.extend(writer.rows)
    meta = {
        "name": name or src.name,
        "classes": list(src.classes),
        "num_classes": len(src.classes),
        "multi_label": src.multi_label,
        "splits": meta_splits,
        "max_side": max_side,
        "quality": quality,
        "seed": seed,
        "source": source,
        "source_options": {k: v for k, v in opts.items() if isinstance(v, (int, float, str, bool, list))},
        "format": 1,
    }
    write_index_and_meta(storage, rows, meta)
    return meta


@dataclass(frozen=True)
class Manifest:
    """A dataset's ``dataset.json`` (``meta``) and ``_index.parquet`` (``index``)."""

    url: str
    meta: dict[str, Any]
    index: pa.Table

    def shard_names(self, split: str | None = None) -> list[str]:
        """Shard file names in ``dataset.json`` order, for one split or all."""
        splits = [split] if split is not None else list(self.meta["splits"])
        for s in splits:
            if s not in self.meta["splits"]:
                raise ValueError(f"{self.url}: no split {s!r}; splits are {list(self.meta['splits'])}")
        return [sh["name"] for s in splits for sh in self.meta["splits"][s]["shards"]]


def load_manifest(url: str, endpoint_url: str | None = None) -> Manifest:
    """Read ``dataset.json`` and ``_index.parquet`` of the dataset at ``url``."""
    storage = open_storage(url, endpoint_url=endpoint_url)
    try:
        meta = json.loads(storage.read_bytes(META_NAME))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{storage.url_of(META_NAME)} not found: not a vitscale dataset (or its write did not finish)"
        ) from None
    index = pq.read_table(io.BytesIO(storage.read_bytes(INDEX_NAME)))
    return Manifest(url=storage.url, meta=meta, index=index)


@dataclass(frozen=True)
class ShardSample:
    """One sample read back from a shard: its members by extension and tar byte range."""

    key: str
    files: dict[str, bytes]
    offset: int
    size: int


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


def iter_shard(f: BinaryIO) -> Iterator[ShardSample]:
    """Samples of a shard stream in order, grouping members by key (the name up to its first dot)."""
    current: ShardSample | None = None
    with tarfile.open(fileobj=f, mode="r|") as tar:
        for info in tar:
            if not info.isfile():
                continue
            base = info.name.rsplit("/", 1)[-1]
            key, _, ext = base.partition(".")
            key = info.name[: len(info.name) - len(base)] + key
            data = tar.extractfile(info).read()  # type: ignore[union-attr]
            end = info.offset_data + ((info.size + 511) // 512) * 512
            if current is not None and current.key == key:
                current.files[ext] = data
                current = ShardSample(key, current.files, current.offset, end - current.offset)
            else:
                if current is not None:
                    yield current
                current = ShardSample(key, {ext: data}, info.offset, end - info.offset)
    if current is not None:
        yield current


def labels_of(s: ShardSample) -> list[int] | None:
    """Labels from a sample's ``.cls`` or ``.json`` member; None when it has neither."""
    if "cls" in s.files:
        return [int(s.files["cls"].decode("ascii").strip())]
    if "json" in s.files:
        return [int(x) for x in json.loads(s.files["json"])["labels"]]
    return None


def verify_dataset(url: str, *, endpoint_url: str | None = None, progress: bool = False) -> list[str]:
    """Re-hash every shard and check counts, keys, labels and byte ranges against the manifest.

    Returns the problems found, each naming the shard (or file) at fault; an empty list means ok.
    """
    storage = open_storage(url, endpoint_url=endpoint_url)
    try:
        man = load_manifest(url, endpoint_url=endpoint_url)
    except (OSError, ValueError, pa.ArrowException) as exc:
        return [f"{url}: cannot load {META_NAME}/{INDEX_NAME}: {exc}"]
    problems: list[str] = []
    meta, num_classes = man.meta, int(man.meta.get("num_classes", 0))
    idx: dict[tuple[str, str], dict[str, Any]] = {}
    keys: set[str] = set()
    for r in man.index.to_pylist():
        if r["key"] in keys:
            problems.append(f"{INDEX_NAME}: key {r['key']!r} ({r['shard']}) appears more than once")
        keys.add(r["key"])
        idx[(r["shard"], r["key"])] = r
    listed = {sh["name"]: (split, sh) for split, sp in meta["splits"].items() for sh in sp["shards"]}
    stray = sorted(n for n in storage.list() if n.endswith(".tar") and n not in listed)
    problems += [f"{n}: shard not listed in {META_NAME}" for n in stray]
    indexed = {}
    for r in idx.values():
        indexed[r["shard"]] = indexed.get(r["shard"], 0) + 1
    for name in sorted(set(indexed) - set(listed)):
        problems.append(f"{name}: in {INDEX_NAME} but not in {META_NAME}")
    for split, sp in meta["splits"].items():
        if sum(sh["samples"] for sh in sp["shards"]) != sp["samples"]:
            problems.append(
                f"{META_NAME}: split {split!r} says {sp['samples']} samples but its shards sum differently"
            )
    with Progress(len(listed), f"verify {storage.url}", unit="shard", enabled=progress) as bar:
        for name, (split, sh) in listed.items():
            problems += _verify_shard(storage, name, split, sh, idx, indexed.get(name, 0), num_classes)
            bar.update()
    return problems


def _verify_shard(
    storage: Storage, name: str, split: str, sh: dict[str, Any], idx: dict[tuple[str, str], dict[str, Any]],
    n_indexed: int, num_classes: int,
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
            for s in iter_shard(io.BufferedReader(hr, 1 << 20)):  # type: ignore[arg-type]
                count += 1
                row = idx.get((name, s.key))
                labels = labels_of(s)
                if "jpg" not in s.files or labels is None:
                    problems.append(f"{name}: sample {s.key!r} lacks .jpg or .cls/.json ({sorted(s.files)})")
                if row is None:
                    problems.append(f"{name}: sample {s.key!r} missing from {INDEX_NAME}")
                    continue
                if (row["offset"], row["size"]) != (s.offset, s.size):
                    problems.append(
                        f"{name}: sample {s.key!r} byte range in index {row['offset']}+{row['size']}"
                        f" != tar {s.offset}+{s.size}"
                    )
                if labels is not None and labels != list(row["labels"]):
                    problems.append(f"{name}: sample {s.key!r} labels {labels} != index {row['labels']}")
                if labels and num_classes and not all(0 <= x < num_classes for x in labels):
                    problems.append(f"{name}: sample {s.key!r} label outside [0, {num_classes})")
                if row["split"] != split:
                    problems.append(
                        f"{name}: sample {s.key!r} indexed under split {row['split']!r}, shard is {split!r}"
                    )
            hr.drain()
        except (OSError, tarfile.TarError, ValueError, UnicodeDecodeError) as exc:
            return problems + [f"{name}: unreadable after {count} samples: {exc}"]
    if hr.sha.hexdigest() != sh["sha256"]:
        problems.append(
            f"{name}: sha256 mismatch (dataset.json {sh['sha256'][:12]}..., file {hr.sha.hexdigest()[:12]}...)"
        )
    if hr.n != sh["bytes"]:
        problems.append(f"{name}: {hr.n} bytes, dataset.json says {sh['bytes']}")
    if count != sh["samples"]:
        problems.append(f"{name}: {count} samples in tar, dataset.json says {sh['samples']}")
    if n_indexed != sh["samples"]:
        problems.append(f"{name}: {n_indexed} rows in {INDEX_NAME}, dataset.json says {sh['samples']}")
    return problems


def dataset_stats(url: str, *, endpoint_url: str | None = None) -> dict[str, Any]:
    """Counts of a dataset from its manifest: shards, samples, bytes, classes, per split."""
    man = load_manifest(url, endpoint_url=endpoint_url)
    meta = man.meta
    split_col = man.index.column("split").to_pylist()
    label_col = man.index.column("labels").to_pylist()
    splits: dict[str, Any] = {}
    for split, sp in meta["splits"].items():
        per_class = np.zeros(meta["num_classes"], dtype=np.int64)
        n_indexed = 0
        for s, ls in zip(split_col, label_col):
            if s == split:
                n_indexed += 1
                per_class[ls] += 1
        splits[split] = {
            "shards": len(sp["shards"]),
            "samples": sp["samples"],
            "indexed_samples": n_indexed,
            "bytes": sum(sh["bytes"] for sh in sp["shards"]),
            "classes_present": int((per_class > 0).sum()),
            "min_per_class": int(per_class.min()) if len(per_class) else 0,
            "max_per_class": int(per_class.max()) if len(per_class) else 0,
        }
    return {
        "url": man.url,
        "name": meta["name"],
        "shards": sum(v["shards"] for v in splits.values()),
        "samples": sum(v["samples"] for v in splits.values()),
        "bytes": sum(v["bytes"] for v in splits.values()),
        "classes": meta["num_classes"],
        "multi_label": meta["multi_label"],
        "max_side": meta.get("max_side"),
        "quality": meta.get("quality"),
        "splits": splits,
    }


def format_stats(stats: dict[str, Any]) -> str:
    """A human-readable table of :func:`dataset_stats` output (the CLI's default view)."""
    lines = [
        f"{stats['name']}  {stats['url']}",
        f"{stats['samples']} samples in {stats['shards']} shards, {stats['bytes'] / 1e6:.1f} MB, "
        f"{stats['classes']} classes{' (multi-label)' if stats['multi_label'] else ''}, "
        f"max side {stats['max_side']} px, JPEG q{stats['quality']}",
        f"{'split':<12}{'shards':>8}{'samples':>10}{'MB':>10}{'classes':>9}{'min/cls':>9}{'max/cls':>9}",
    ]
    for s, v in stats["splits"].items():
        lines.append(
            f"{s:<12}{v['shards']:>8}{v['samples']:>10}{v['bytes'] / 1e6:>10.1f}"
            f"{v['classes_present']:>9}{v['min_per_class']:>9}{v['max_per_class']:>9}"
        )
    return "\n".join(lines)
