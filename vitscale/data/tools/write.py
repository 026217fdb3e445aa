"""Write a dataset: shuffle a source's samples into splits, encode JPEGs, pack them into shards.

``write_dataset`` backs ``vitscale shards write``; :class:`ShardWriter` is the shard packer that
dedup reuses to copy a dataset. The files it writes and their schema are
:mod:`vitscale.data.format`'s; their bytes are reproducible (fixed tar metadata, seeded order).

Source files that are no readable image (not an image, empty, truncated, a decompression bomb:
:mod:`vitscale.data.tools.images`) are skipped, counted and listed (``bad_files`` in the summary
and in ``dataset.json``) up to ``max_bad``; one more stops the write with one line naming the file.
The destination is claimed, filled and published by :mod:`vitscale.data.tools.publish`: a failed
or interrupted write never leaves a dataset, and writing again to the same place works.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from vitscale.config.checks import check, positive_int
from vitscale.config.checks import seed as check_seed
from vitscale.config.errors import UserError
from vitscale.data.config import check_splits
from vitscale.data.format import (
    FORMAT,
    DatasetMeta,
    ShardMeta,
    SplitMeta,
    shard_name,
    write_index_and_meta,
)
from vitscale.data.storage import Storage, open_storage
from vitscale.data.storage.cleanup import after_error, remove_file, spool_file
from vitscale.data.tools import publish
from vitscale.data.tools.images import MAX_PIXELS, UnreadableImage, encode_image
from vitscale.data.tools.progress import Progress
from vitscale.data.tools.sources import Sample, Source, check_outside_source, open_source

__all__ = [
    "ShardWriter",
    "assign_splits",
    "encode_image",
    "parse_splits",
    "write_dataset",
]


def parse_splits(text: str) -> dict[str, float]:
    """``"train=0.9,minival=0.1"`` -> ``{"train": 0.9, "minival": 0.1}`` (the CLI's ``--split``)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, frac = part.partition("=")
        if not eq:
            raise UserError(f"--split item {part!r} must look like name=fraction, e.g. train=0.9")
        try:
            out[name.strip()] = float(frac)
        except ValueError:
            raise UserError(f"--split {name!r}: fraction {frac!r} is not a number") from None
    check_splits(out)
    return out


def assign_splits(n: int, splits: dict[str, float], seed: int) -> dict[str, np.ndarray]:
    """Carve ``range(n)`` into splits: a seeded permutation cut by largest-remainder counts.

    Pure function of (n, splits, seed). Each returned array holds source indices in the order they
    are written (shuffled, so shards mix classes); arrays are disjoint and cover ``range(n)``, and
    each split's size is within 1 of ``fraction * n``.
    """
    check_splits(splits)
    names = list(splits)
    exact = np.array([splits[s] * n for s in names])
    counts = np.floor(exact).astype(np.int64)
    # Hand the leftover samples to the largest fractional parts (ties: first listed split).
    for j in np.argsort(-(exact - counts), kind="stable")[: n - int(counts.sum())]:
        counts[j] += 1
    perm = np.random.default_rng(seed).permutation(n)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return {s: perm[bounds[j] : bounds[j + 1]] for j, s in enumerate(names)}


class _HashingFile:
    """A write-only file wrapper that SHA-256s and counts what passes through, and CRC-32s what
    passed since the last :meth:`mark` (one sample's record: the index's ``crc32``)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha, self.n, self.crc = f, hashlib.sha256(), 0, 0

    def mark(self) -> None:
        self.crc = 0

    def write(self, b: bytes) -> int:
        self.sha.update(b)
        self.crc = zlib.crc32(b, self.crc)
        self.n += len(b)
        return self.f.write(b)

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        self.f.flush()


def safe_member_name(name: str) -> str:
    """A tar member name that stays inside the directory a tar is extracted to: relative, no `..`
    part, no backslash or NUL (keys of an adopted or hostile dataset reach dedup's writer as they are)."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or "\0" in name or ".." in parts or "" in parts:
        raise ValueError(f"refusing tar member name {name!r}: it would escape the directory it is extracted to")
    return name


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(safe_member_name(name))
    info.size, info.mode, info.mtime = len(data), 0o444, 0  # fixed metadata: reproducible bytes
    return info, io.BytesIO(data)


@dataclass
class ShardWriter:
    """Writes one split's shards to ``storage`` through a local spool file, one shard at a time."""

    storage: Storage
    split: str
    shard_size: int
    multi_label: bool
    shards: list[ShardMeta] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    _tmp: Any = None
    _tar: tarfile.TarFile | None = None
    _hf: _HashingFile | None = None
    _count: int = 0

    def add(self, key: str, image: bytes, labels: Sequence[int], width: int | None, height: int | None, *,
            ext: str = "jpg") -> None:
        """Append one sample, its image as ``{key}.{ext}`` (dedup copies PNGs as they are; None: a size unknown)."""
        if self._tar is None:
            self._open()
        if self._tar is None or self._hf is None:
            raise RuntimeError("ShardWriter: shard failed to open")
        start = self._tar.offset
        self._hf.mark()
        self._tar.addfile(*_member(f"{key}.{ext}", image))
        if self.multi_label:
            self._tar.addfile(*_member(f"{key}.json", json.dumps({"labels": list(labels)}).encode()))
        elif labels:
            self._tar.addfile(*_member(f"{key}.cls", str(labels[0]).encode("ascii")))
        # No label at all: an unlabelled source (images alone); the sample is its image member.
        name = shard_name(self.split, len(self.shards))
        self.rows.append(
            dict(split=self.split, shard=name, key=key, labels=list(labels), offset=start,
                 size=self._tar.offset - start, width=width, height=height, crc32=self._hf.crc)
        )
        self._count += 1
        if self._count >= self.shard_size:
            self.finish_shard()

    def _open(self) -> None:
        # Open for the shard's whole life (samples arrive one call at a time); finish_shard closes both.
        self._tmp = spool_file("vitscale-spool-shard-", ".tar")  # a killed write's is removed by the next
        self._hf = _HashingFile(self._tmp)
        self._tar = tarfile.open(  # type: ignore[call-overload]  # noqa: SIM115 -- a file-like the stubs do not know
            fileobj=self._hf, mode="w", format=tarfile.PAX_FORMAT
        )
        self._count = 0

    def finish_shard(self) -> None:
        """Close the open shard (if any), upload it and record its entry."""
        if self._tar is None:
            return
        if self._hf is None:
            raise RuntimeError("ShardWriter: shard state lost")
        self._tar.close()
        self._tmp.flush()  # open (and locked: cleanup.spool_file) until removed
        name = shard_name(self.split, len(self.shards))
        entry = ShardMeta(name, self._count, self._hf.sha.hexdigest(), self._hf.n)
        tmp, spool = self._tmp, self._tmp.name
        # The shard is closed: from here its spool file is this call's to remove, not abort()'s.
        self._tar = self._hf = self._tmp = None
        try:
            self.storage.write_file(name, spool)
            remove_file(spool)
        except BaseException as exc:
            after_error(exc, f"removing the spool file {spool}", lambda: remove_file(spool))
            raise
        finally:
            tmp.close()
        self.shards.append(entry)

    def abort(self, error: BaseException) -> None:
        """Drop the open shard's spool file after ``error`` (which a failure to do so never replaces)."""
        if self._tmp is None:
            return
        tmp, self._tar, self._hf, self._tmp = self._tmp, None, None, None

        def drop() -> None:
            try:
                remove_file(tmp.name)
            finally:
                tmp.close()  # its lock last: a sweep never takes a spool still being removed

        after_error(error, f"removing the spool file {tmp.name}", drop)


_Encoded = tuple[Sample, bytes, int, int] | tuple[int, str]
"""A sample with its JPEG and size, or (source index, why it was skipped)."""


def _encoded_in_order(
    source: Source,
    order: np.ndarray,
    encode: Callable[[Sample], tuple[Sample, bytes, int, int]],
    workers: int,
) -> Iterator[_Encoded]:
    """Encode samples on a thread pool (PIL releases the GIL) while keeping write order."""

    def one(j: int) -> _Encoded:
        try:
            return encode(source[j])
        except UnreadableImage as exc:
            return j, str(exc)
        except (OSError, ValueError) as exc:  # the file is gone or unreadable (disk, object store)
            return j, f"cannot read: {type(exc).__name__}: {exc}"

    window = max(4, 4 * workers)  # bounded in-flight work: memory stays flat on big sets
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: list[Any] = []
        for i in order:
            pending.append(pool.submit(one, int(i)))
            if len(pending) >= window:
                yield pending.pop(0).result()
        for fut in pending:
            yield fut.result()


def _predefined_splits(
    src: Source, spec: str, seed: int, fractions: dict[str, float] | None
) -> dict[str, np.ndarray] | None:
    """The source's own splits, each in a seeded shuffled order (shards mix classes); None if it has none."""
    own = src.predefined_splits()
    if own is None:
        return None
    if fractions:
        raise UserError(f"--split: source {spec!r} has its own splits ({', '.join(own)}); leave --split out")
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    seen = np.zeros(len(src), dtype=bool)
    for name, idx in own.items():
        idx = np.asarray(idx, dtype=np.int64)
        check(bool(name) and all(c.isalnum() or c == "_" for c in name), "splits",
              f"{spec}: split name {name!r} must be letters, digits or '_' (it names shard files)")
        if not idx.size:
            raise UserError(f"{spec}: split {name!r} has no samples")
        if idx.min() < 0 or idx.max() >= len(src) or seen[idx].any() or len(np.unique(idx)) != idx.size:
            raise UserError(f"{spec}: split {name!r} repeats samples or has indices outside [0, {len(src)})")
        seen[idx] = True
        out[name] = idx[rng.permutation(idx.size)]
    return out


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
    max_bad: int = 100,
    max_pixels: int | None = None,
    chroma: str = "4:2:0",
) -> dict[str, Any]:
    """Write ``source`` (see :func:`vitscale.data.tools.sources.open_source`) as shards at ``out``.

    Images are shrunk to fit ``max_side`` (never enlarged) and JPEG-encoded (baseline, Pillow's
    libjpeg) at ``quality`` with ``chroma`` subsampling ("4:2:0", "4:2:2" or "4:4:4": see
    :func:`~vitscale.data.tools.images.encode_image`; recorded in dataset.json as ``extra.chroma``);
    samples are shuffled and carved into ``splits`` (default ``{"train": 1.0}``) from ``seed``.
    A source with its own splits (:meth:`Source.predefined_splits`: CIFAR, Pets, Flowers,
    ImageNet) is written with exactly those, each shuffled from ``seed``; ``splits`` must then be
    left out.
    ``seed`` also seeds the synthetic and fractal sources unless ``source_options`` sets their own.
    Up to ``max_bad`` unreadable source files (or images over ``max_pixels``) are skipped and
    listed; one more raises ``ValueError`` naming it (``max_pixels`` None: :data:`MAX_PIXELS`). Returns the
    ``dataset.json`` content.
    """
    max_pixels = MAX_PIXELS if max_pixels is None else max_pixels
    _check_options(shard_size, max_bad, max_pixels, max_side, quality, chroma)
    check_seed(seed, "seed")  # NumPy refuses a negative one deep in the split's shuffle
    opts = dict(source_options or {})
    if source.partition(":")[0] in ("synthetic", "fractal"):
        opts.setdefault("seed", seed)
    check_outside_source(source, out)
    src = open_source(source, **opts)
    by_split = _predefined_splits(src, source, seed, splits)
    if by_split is None:
        by_split = assign_splits(len(src), dict(splits) if splits else {"train": 1.0}, seed)
    storage = open_storage(out, endpoint_url=endpoint_url)
    publish.claim(storage)
    n_workers = workers or min(8, os.cpu_count() or 1)

    def encode(s: Sample) -> tuple[Sample, bytes, int, int]:
        return (s, *encode_image(s.image, max_side, quality, max_pixels, chroma))

    meta_splits: dict[str, SplitMeta] = {}
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    bad: list[dict[str, str]] = []
    try:
        with Progress(len(src), f"write {storage.url}", unit="img", enabled=progress) as bar:
            for split, order in by_split.items():
                writer = ShardWriter(storage, split, shard_size, src.multi_label)
                _write_split(writer, src, _encoded_in_order(src, order, encode, n_workers), bar, seen, bad,
                             max_bad, source)
                meta_splits[split] = SplitMeta(len(writer.rows), tuple(writer.shards))
                rows.extend(writer.rows)
        empty = [s for s, sp in meta_splits.items() if sp.samples == 0]
        if empty:
            raise UserError(f"{source}: split {empty[0]!r} has no readable images "
                             f"({len(bad)} skipped, e.g. {bad[0]['file'] if bad else '-'})")
        meta = _meta(src, name, meta_splits, max_side, quality, seed, source, opts, bad)
        meta = dataclasses.replace(meta, extra={**meta.extra, "chroma": chroma})
        write_index_and_meta(storage, rows, meta)
    except BaseException as exc:
        publish.abort(storage, exc)
        raise
    publish.release(storage)
    return meta.to_json()


def _check_options(shard_size: int, max_bad: int, max_pixels: int, max_side: int, quality: int, chroma: str) -> None:
    """:func:`write_dataset`'s own values, each refused with a line naming it."""
    positive_int(shard_size, "shard_size")
    check(isinstance(max_bad, int) and max_bad >= 0, "max_bad", f"must be an integer >= 0, got {max_bad!r}")
    positive_int(max_pixels, "max_pixels")
    check(max_side >= 8, "max_side", f"must be >= 8 px, got {max_side}")
    check(1 <= quality <= 95, "quality", f"must be in [1, 95] (JPEG), got {quality}")
    check(chroma in ("4:2:0", "4:2:2", "4:4:4"), "chroma", f"must be 4:2:0, 4:2:2 or 4:4:4, got {chroma!r}")


def _write_split(writer: ShardWriter, src: Source, encoded: Iterator[_Encoded], bar: Progress, seen: set[str],
                 bad: list[dict[str, str]], max_bad: int, source: str) -> None:
    """One split's encoded samples into ``writer``'s shards; an unreadable one is listed in ``bad`` (more
    than ``max_bad``: refused), a key seen before is refused; on any error the unfinished shard is dropped."""
    try:
        for item in encoded:
            bar.update()
            if len(item) == 2:
                bad.append({"file": src.origin(item[0]), "error": item[1]})
                if len(bad) > max_bad:
                    raise UserError(f"{len(bad)} unreadable source files, more than --max-bad "
                                     f"{max_bad}; the last: {bad[-1]['file']}: {bad[-1]['error']}")
                continue
            sample, jpeg, w, h = item
            if sample.key in seen:
                raise UserError(f"{source}: duplicate sample key {sample.key!r}; keys must be unique")
            seen.add(sample.key)
            writer.add(sample.key, jpeg, sample.labels, w, h)
        writer.finish_shard()
    except BaseException as exc:
        writer.abort(exc)  # drops an unfinished shard's spool file
        raise


def _meta(src: Source, name: str | None, splits: dict[str, SplitMeta], max_side: int, quality: int, seed: int,
          source: str, opts: dict[str, Any], bad: list[dict[str, str]]) -> DatasetMeta:
    return DatasetMeta(
        name=name or src.name,
        classes=tuple(src.classes),
        num_classes=len(src.classes),
        multi_label=src.multi_label,
        splits=splits,
        max_side=max_side,
        quality=quality,
        extra={
            "seed": seed,
            "source": source,
            "source_options": {k: v for k, v in opts.items() if isinstance(v, (int, float, str, bool, list))},
            "format": FORMAT,
            "bad_files": bad,
        },
    )

