"""The dataset contract: the one module that names, reads, writes and validates a dataset's files.

A dataset folder (local or ``s3://``) holds ``{split}-{n:06d}.tar`` shards, ``_index.parquet``
(one row per sample: split, shard, key, labels, offset, size, width, height; ``offset``/``size``
cover the sample's tar members incl. headers and padding, so one ranged read fetches a sample) and
``dataset.json``, the dataset's metadata (name, classes, splits with per-shard sample counts,
SHA-256 and bytes). The index and then ``dataset.json`` are written last: a folder with a
``dataset.json`` is complete.

Each sample is ``{key}.jpg`` plus ``{key}.cls`` (ASCII class index) for single-label data or
``{key}.json`` (``{"labels": [...]}``) for multi-label data.

Every reader and writer (the training stream, the shard writer, stats, verify, dedup, bench) goes
through here: :func:`read_meta` parses ``dataset.json`` into a validated :class:`DatasetMeta`,
:func:`read_index` loads the whole index, :func:`open_dataset` checks one split against its shards
and index before any training, and :func:`write_index_and_meta` writes both files in that order.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vitscale.data.storage import LocalStorage, Storage, open_storage

__all__ = [
    "INDEX_COLUMNS", "INDEX_NAME", "INDEX_SCHEMA", "META_NAME", "DatasetError", "DatasetMeta",
    "OpenDataset", "ShardIndex", "ShardMeta", "SplitMeta", "has_dataset", "open_dataset",
    "read_index", "read_meta", "shard_name", "write_index_and_meta",
]

META_NAME = "dataset.json"
INDEX_NAME = "_index.parquet"
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
INDEX_COLUMNS = ("split", "shard", "key", "offset", "size")
"""The index columns a reader needs (third-party writers may leave out the others)."""


def shard_name(split: str, n: int) -> str:
    """``{split}-{n:06d}.tar``."""
    return f"{split}-{n:06d}.tar"


class DatasetError(ValueError):
    """The dataset cannot be used: missing shard, unreadable metadata/index, or they disagree."""


@dataclass(frozen=True)
class ShardMeta:
    """One shard's entry in ``dataset.json``."""

    name: str
    samples: int
    sha256: str | None = None
    nbytes: int | None = None
    """File size (``"bytes"`` in ``dataset.json``)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "samples": self.samples}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        if self.nbytes is not None:
            out["bytes"] = self.nbytes
        return out


@dataclass(frozen=True)
class SplitMeta:
    """One split's entry: its sample count as stored, and its shards in order."""

    samples: int
    shards: tuple[ShardMeta, ...]

    @property
    def shard_names(self) -> tuple[str, ...]:
        return tuple(sh.name for sh in self.shards)

    @property
    def counts(self) -> tuple[int, ...]:
        """Samples per shard, in order."""
        return tuple(sh.samples for sh in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {"samples": self.samples, "shards": [sh.to_json() for sh in self.shards]}


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


_TYPED_KEYS = ("name", "classes", "num_classes", "multi_label", "splits", "max_side", "quality")


@dataclass(frozen=True)
class DatasetMeta:
    """A dataset's metadata: ``dataset.json`` parsed and validated."""

    name: str
    num_classes: int
    multi_label: bool
    splits: Mapping[str, SplitMeta]
    classes: tuple[str, ...] = ()
    max_side: int | None = None
    quality: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Every other key (seed, source, source_options, format, dedup, ...), in file order."""

    def split(self, split: str) -> SplitMeta:
        """The entry of ``split``; :class:`DatasetError` naming the splits there are."""
        if split not in self.splits:
            raise DatasetError(f"no split {split!r}; splits are {list(self.splits)}")
        return self.splits[split]

    def samples(self, split: str) -> int:
        """Samples of ``split``, as ``dataset.json`` states them."""
        return self.split(split).samples

    def shard_names(self, split: str | None = None) -> list[str]:
        """Shard file names in ``dataset.json`` order, for one split or all."""
        splits = [split] if split is not None else list(self.splits)
        return [n for s in splits for n in self.split(s).shard_names]

    def to_json(self) -> dict[str, Any]:
        """The ``dataset.json`` object (key order as the writer has always written it)."""
        out: dict[str, Any] = {
            "name": self.name,
            "classes": list(self.classes),
            "num_classes": self.num_classes,
            "multi_label": self.multi_label,
            "splits": {s: sp.to_json() for s, sp in self.splits.items()},
        }
        if self.max_side is not None:
            out["max_side"] = self.max_side
        if self.quality is not None:
            out["quality"] = self.quality
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = META_NAME) -> DatasetMeta:
        """Parse and validate a ``dataset.json`` object; errors name ``where``."""
        if not isinstance(obj, dict) or not isinstance(obj.get("splits"), dict):
            raise DatasetError(f"{where} has no 'splits' mapping")
        try:
            splits = {}
            for s, sp in obj["splits"].items():
                shards = tuple(
                    ShardMeta(str(sh["name"]), int(sh["samples"]), sh.get("sha256"), _opt_int(sh.get("bytes")))
                    for sh in sp["shards"]
                )
                samples = int(sp["samples"]) if "samples" in sp else sum(sh.samples for sh in shards)
                splits[str(s)] = SplitMeta(samples, shards)
            meta = cls(
                name=str(obj.get("name", "")),
                num_classes=int(obj["num_classes"]),
                multi_label=bool(obj.get("multi_label", False)),
                splits=splits,
                classes=tuple(str(c) for c in obj.get("classes", ())),
                max_side=_opt_int(obj.get("max_side")),
                quality=_opt_int(obj.get("quality")),
                extra={k: v for k, v in obj.items() if k not in _TYPED_KEYS},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DatasetError(f"{where} is malformed: {exc!r}") from exc
        if meta.num_classes < 1:
            raise DatasetError(f"{where}: num_classes must be >= 1")
        return meta


def _storage(url: str | Storage, endpoint_url: str | None) -> Storage:
    return url if isinstance(url, Storage) else open_storage(url, endpoint_url=endpoint_url)


def has_dataset(url: str | Storage, *, endpoint_url: str | None = None) -> bool:
    """Whether a complete dataset (its ``dataset.json``) is at ``url``."""
    return _storage(url, endpoint_url).exists(META_NAME)


def read_meta(url: str | Storage, *, endpoint_url: str | None = None) -> DatasetMeta:
    """The metadata of the dataset at ``url`` (a folder, ``s3://bucket/prefix`` or a Storage).

    Raises FileNotFoundError when there is no ``dataset.json``, :class:`DatasetError` naming it
    when it is unreadable or malformed.
    """
    storage = _storage(url, endpoint_url)
    where = storage.url_of(META_NAME)
    try:
        obj = json.loads(storage.read_bytes(META_NAME))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no {META_NAME} at {where}: not a vitscale dataset, or its write did not finish "
            "(write one with `vitscale shards write`)"
        ) from None
    except (OSError, ValueError) as exc:
        raise DatasetError(f"cannot read {where}: {exc}") from exc
    return DatasetMeta.from_json(obj, where)


def read_index(url: str | Storage, *, endpoint_url: str | None = None) -> pa.Table:
    """The whole ``_index.parquet`` of the dataset at ``url`` (tools; the stream reads per shard)."""
    storage = _storage(url, endpoint_url)
    return pq.read_table(io.BytesIO(storage.read_bytes(INDEX_NAME)))


def write_index_and_meta(storage: Storage, rows: list[dict[str, Any]], meta: DatasetMeta) -> None:
    """Write ``_index.parquet`` then ``dataset.json`` (last: its presence marks a complete set)."""
    table = pa.Table.from_pylist(rows, schema=INDEX_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    storage.write_bytes(INDEX_NAME, buf.getvalue())
    storage.write_bytes(META_NAME, (json.dumps(meta.to_json(), indent=2) + "\n").encode())


@dataclass(frozen=True)
class ShardIndex:
    """Where each sample of one shard lives, in tar order."""

    offsets: np.ndarray
    """(n,) int64 byte offset of the sample's first tar header."""
    sizes: np.ndarray
    """(n,) int64 bytes of the sample's record, padding included."""
    keys: pa.Array
    """(n,) sample keys (an Arrow array: no Python objects per sample, cheap to fork)."""

    def key(self, i: int) -> str:
        """Key of the shard's ``i``-th sample."""
        return str(self.keys[i].as_py())


@dataclass(frozen=True, eq=False)
class OpenDataset:
    """A validated split of a dataset: its metadata plus a local path to its index."""

    storage: Storage
    split: str
    meta: DatasetMeta
    shard_names: tuple[str, ...]
    counts: tuple[int, ...]
    index_path: str

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def classes(self) -> tuple[str, ...]:
        return self.meta.classes

    @property
    def num_classes(self) -> int:
        return self.meta.num_classes

    @property
    def multi_label(self) -> bool:
        return self.meta.multi_label

    def load_index(self, shards: Iterable[int]) -> dict[int, ShardIndex]:
        """Index rows of the given shard numbers only (parquet filter pushdown, not a full scan)."""
        wanted = sorted(set(int(s) for s in shards))
        if not wanted:
            return {}
        names = [self.shard_names[s] for s in wanted]
        url = self.storage.url_of(INDEX_NAME)
        try:
            table = pq.read_table(
                self.index_path,
                columns=["shard", "key", "offset", "size"],
                filters=[("split", "=", self.split), ("shard", "in", names)],
            )
        except (OSError, pa.ArrowInvalid) as exc:
            raise DatasetError(f"cannot read {url}: {exc}") from exc
        table = table.sort_by([("shard", "ascending"), ("offset", "ascending")])
        vc = pc.value_counts(table.column("shard"))  # in order of appearance = sorted order
        found = dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))
        offsets = table.column("offset").to_numpy().astype(np.int64)
        sizes = table.column("size").to_numpy().astype(np.int64)
        keys = table.column("key").combine_chunks()
        out: dict[int, ShardIndex] = {}
        row = 0
        by_name = {n: s for s, n in zip(wanted, names)}
        for name in vc.field("values").to_pylist():
            n = found[name]
            s = by_name[name]
            if n != self.counts[s]:
                raise DatasetError(
                    f"{url} has {n} rows for shard {name}, {META_NAME} says {self.counts[s]}: "
                    f"rewrite the index or {META_NAME}"
                )
            out[s] = ShardIndex(offsets[row : row + n], sizes[row : row + n], keys.slice(row, n))
            row += n
        for s, name in zip(wanted, names):
            if s not in out and self.counts[s] > 0:
                raise DatasetError(f"{url} has no rows for shard {name}")
        return out


def _local_index_path(storage: Storage) -> str:
    """A local file path for the index: the file itself, or a temp copy of a remote one."""
    if isinstance(storage, LocalStorage):
        path = storage.url_of(INDEX_NAME)
        if not os.path.isfile(path):
            raise DatasetError(f"no index at {path}: rewrite the dataset with `vitscale shards write`")
        return path
    fd, path = tempfile.mkstemp(prefix="vitscale-index-", suffix=".parquet")
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    try:
        with os.fdopen(fd, "wb") as dst, storage.open_read(INDEX_NAME) as src:
            while chunk := src.read(8 << 20):  # streamed: a JFT-sized index never sits in memory
                dst.write(chunk)
    except FileNotFoundError as exc:
        raise DatasetError(f"no index at {storage.url_of(INDEX_NAME)}") from exc
    return path


def _index_counts(path: str, split: str, url: str) -> Counter[str]:
    """Rows per shard of ``split``, streamed in record batches (memory stays flat)."""
    try:
        pf = pq.ParquetFile(path)
        missing = set(INDEX_COLUMNS) - set(pf.schema_arrow.names)
        if missing:
            raise DatasetError(f"{url} lacks columns {sorted(missing)}")
        counts: Counter[str] = Counter()
        for batch in pf.iter_batches(columns=["split", "shard"], batch_size=1 << 20):
            shards = batch.column(1).filter(pc.equal(batch.column(0), split))
            vc = pc.value_counts(shards)
            counts.update(dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())))
        return counts
    except (OSError, pa.ArrowInvalid) as exc:
        raise DatasetError(f"cannot read {url}: {exc}") from exc


def open_dataset(url: str, split: str, *, endpoint_url: str | None = None) -> OpenDataset:
    """Open and validate ``split`` of the dataset at ``url`` (folder or ``s3://bucket/prefix``).

    Checks, failing with :class:`DatasetError` before any training: ``dataset.json`` is readable and
    lists the split; every listed shard exists; ``_index.parquet`` has the contract's columns and,
    per shard, exactly as many rows as ``dataset.json``'s sample count.
    """
    storage = open_storage(url, endpoint_url=endpoint_url)
    meta_url, index_url = storage.url_of(META_NAME), storage.url_of(INDEX_NAME)
    try:
        meta = read_meta(storage)
    except FileNotFoundError as exc:
        raise DatasetError(str(exc)) from exc
    if split not in meta.splits:
        raise DatasetError(f"split {split!r} not in {meta_url}; it has {sorted(meta.splits)}")
    names, counts = meta.splits[split].shard_names, meta.splits[split].counts
    present = set(storage.list())
    missing = [n for n in names if n not in present]
    if missing:
        raise DatasetError(
            f"{len(missing)} shard(s) of split {split!r} missing under {storage.url}: "
            f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}"
        )
    if INDEX_NAME not in present:
        raise DatasetError(f"no index at {index_url}")
    index_path = _local_index_path(storage)
    rows = _index_counts(index_path, split, index_url)
    bad = [(n, rows.get(n, 0), c) for n, c in zip(names, counts) if rows.get(n, 0) != c]
    extra = sorted(set(rows) - set(names))
    if bad or extra:
        detail = "; ".join(f"{n}: index {r} vs {META_NAME} {c}" for n, r, c in bad[:10])
        if extra:
            detail += f"; index rows for shards not in {META_NAME}: {', '.join(extra[:10])}"
        raise DatasetError(
            f"{index_url} disagrees with {meta_url} for split {split!r} ({detail}): "
            "the dataset is damaged or half-written; rewrite it"
        )
    return OpenDataset(storage, split, meta, names, counts, index_path)
