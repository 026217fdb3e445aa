"""One split of a dataset, validated against its shards and index before training; optionally one part of a carve.

See the package docstring (`vitscale.data.format`) for the contract.
"""


from __future__ import annotations

import atexit
import contextlib
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vitscale.data.carve import Carve
from vitscale.data.format.index import IndexFile
from vitscale.data.format.meta import (
    CRC_COLUMN,
    INDEX_NAME,
    LABEL_SOURCE,
    META_NAME,
    PARQUET_THREADS,
    DatasetError,
    DatasetMeta,
    check_index_schema,
    read_meta,
    shard_storage,
)
from vitscale.data.storage import LocalStorage, Storage, open_storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardIndex:
    """Where each sample of one shard lives, in tar order."""

    offsets: np.ndarray
    """(n,) int64 byte offset of the sample's first tar header."""
    sizes: np.ndarray
    """(n,) int64 bytes of the sample's record, padding included."""
    keys: pa.Array
    """(n,) sample keys (an Arrow array: no Python objects per sample, cheap to fork)."""
    crcs: np.ndarray | None = None
    """(n,) int64 ``zlib.crc32`` of each sample's record, -1 where the index has none; None: no
    ``crc32`` column (datasets written before it existed)."""

    labels: list[list[int]] | None = None
    """(n,) class ids per sample when the dataset's labels live in the index (``label_source:
    index`` in ``dataset.json``: adopted WebDataset shards); None: read from each sample's members."""

    def crc(self, i: int) -> int:
        """The checksum of the shard's ``i``-th sample, or -1 when there is none to check."""
        return -1 if self.crcs is None else int(self.crcs[i])

    def take(self, keep: np.ndarray) -> ShardIndex:
        """The rows ``keep`` (positions), in that order."""
        return ShardIndex(self.offsets[keep], self.sizes[keep], self.keys.take(pa.array(keep)),
                          None if self.crcs is None else self.crcs[keep],
                          None if self.labels is None else [self.labels[int(i)] for i in keep])

    def key(self, i: int) -> str:
        """Key of the shard's ``i``-th sample."""
        return str(self.keys[i].as_py())


@dataclass(frozen=True, eq=False)
class OpenDataset:
    """A validated split of a dataset: its metadata plus its index (read per shard, lazily)."""

    storage: Storage
    split: str
    meta: DatasetMeta
    shard_names: tuple[str, ...]
    counts: tuple[int, ...]
    """Samples per shard this view reads (all of the split, or one part of a carve)."""
    index: IndexFile
    """``_index.parquet``, read with ranged reads through its storage (footer, then row groups)."""
    index_path: str | None = None
    """A local copy of a legacy-layout index (filtered scans of it); None: the per-shard layout,
    whose row groups :meth:`load_index` reads one by one (see :mod:`vitscale.data.format.index`)."""
    carve: Carve | None = None
    """Read only one part (dev or rest) of a carve of the split; None = the whole split."""
    has_crc: bool = False
    """The index has the ``crc32`` column: each sample's bytes are checked when read."""

    @property
    def lazy(self) -> bool:
        """The per-shard layout: index rows are read per shard when asked for, none at open."""
        return self.index_path is None

    @property
    def labels_in_index(self) -> bool:
        """Labels come from the index's ``labels`` column, not from the samples' members."""
        return self.meta.extra.get(LABEL_SOURCE) == "index"

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

    @property
    def _columns(self) -> list[str]:
        return (["shard", "key", "offset", "size"] + ([CRC_COLUMN] if self.has_crc else [])
                + (["labels"] if self.labels_in_index else []))

    def load_index(self, shards: Iterable[int]) -> dict[int, ShardIndex]:
        """Index rows of the given shard numbers only.

        Per-shard layout: just those shards' row groups, with ranged reads (the cost follows the
        shards asked for, not the dataset). Legacy layout: parquet filter pushdown over the local
        copy of the whole index."""
        wanted = sorted({int(s) for s in shards})
        if not wanted:
            return {}
        if self.index_path is not None:
            return self._read_legacy(wanted)
        layout = self.index.layout
        if layout is None:
            raise DatasetError(f"{self.index.url} changed since the dataset was opened: open it again")
        listed = self.meta.splits[self.split].counts
        out: dict[int, ShardIndex] = {}
        groups: list[tuple[int, int]] = []  # (shard, row group)
        for s in wanted:
            name = self.shard_names[s]
            group = layout.row_groups.get((self.split, name))
            if group is not None:
                groups.append((s, group))
            elif listed[s] == 0:  # a shard without samples has no row group
                schema = self.index.metadata.schema.to_arrow_schema()
                out[s] = self._finish(s, name, pa.schema([schema.field(c) for c in self._columns]).empty_table())
            else:
                raise DatasetError(f"{self.index.url} has no rows for shard {name}")
        groups.sort(key=lambda sg: sg[1])  # file order: one pass over the file
        table = self.index.read_row_groups([g for _, g in groups], self._columns)
        row = 0
        for s, group in groups:
            name, n = self.shard_names[s], layout.rows[(self.split, self.shard_names[s])]
            rows = table.slice(row, n)
            row += n
            if n != listed[s] or not pc.all(pc.equal(rows.column("shard"), name)).as_py():
                raise DatasetError(f"{self.index.url}: row group {group} is not the {listed[s]} rows of shard "
                                   f"{name}: the index was replaced; rewrite it")
            out[s] = self._finish(s, name, rows)
        if row != table.num_rows:
            raise DatasetError(f"{self.index.url} changed since the dataset was opened: open it again")
        return out

    def _finish(self, s: int, name: str, table: pa.Table) -> ShardIndex:
        """One shard's :class:`ShardIndex` from its rows (tar order), its carve part applied."""
        for col in ("offset", "size"):  # a byte range read as given: a null or negative one is a damaged index
            values = table.column(col)
            if values.null_count or (len(values) and pc.min(values).as_py() < 0):
                raise DatasetError(f"{self.index.url}: shard {name} has rows with a null or negative {col}: "
                                   "a damaged index, or one another tool rewrote")
        offsets = table.column("offset").to_numpy().astype(np.int64)
        if offsets.size > 1 and (np.diff(offsets) < 0).any():
            table = table.take(pa.array(np.argsort(offsets, kind="stable")))
            offsets = table.column("offset").to_numpy().astype(np.int64)
        shard = ShardIndex(offsets, table.column("size").to_numpy().astype(np.int64),
                           table.column("key").combine_chunks(),
                           table.column(CRC_COLUMN).fill_null(-1).to_numpy().astype(np.int64) if self.has_crc
                           else None,
                           table.column("labels").to_pylist() if self.labels_in_index else None)
        if self.carve is not None:
            shard = shard.take(np.flatnonzero(self.carve.select(shard.keys.to_pylist())))
        if len(shard.offsets) != self.counts[s]:
            raise DatasetError(f"{self.index.url}: shard {name} selects {len(shard.offsets)} samples of "
                               f"{self.carve}, expected {self.counts[s]}")
        return shard

    def _read_legacy(self, wanted: list[int]) -> dict[int, ShardIndex]:
        """The rows of shards ``wanted`` from the local copy of a legacy-layout index, all at once."""
        if not wanted:
            return {}
        names = [self.shard_names[s] for s in wanted]
        url = self.index.url
        try:
            # The dataset scanner, not `read_parquet`: the training stream asks again at every new shard set,
            # and the filter can skip other shards' row groups by their statistics instead of decoding the
            # whole index each time (the scanner's pool threads are the cost of that).
            table = pq.read_table(
                self.index_path,
                columns=self._columns,
                filters=[("split", "=", self.split), ("shard", "in", names)],
                use_threads=PARQUET_THREADS,
            )
        except (OSError, pa.ArrowInvalid) as exc:
            raise DatasetError(f"cannot read {url}: {exc}") from exc
        table = table.sort_by([("shard", "ascending"), ("offset", "ascending")])
        vc = pc.value_counts(table.column("shard"))  # in order of appearance = sorted order
        found = dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))
        out: dict[int, ShardIndex] = {}
        row = 0
        by_name = {n: s for s, n in zip(wanted, names)}
        for name in vc.field("values").to_pylist():
            n = found[name]
            s = by_name[name]
            listed = self.meta.splits[self.split].counts[s]
            if n != listed:
                raise DatasetError(
                    f"{url} has {n} rows for shard {name}, {META_NAME} says {listed}: "
                    f"rewrite the index or {META_NAME}"
                )
            out[s] = self._finish(s, name, table.slice(row, n))
            row += n
        for s, name in zip(wanted, names):
            if s not in out and self.counts[s] > 0:
                raise DatasetError(f"{url} has no rows for shard {name}")
        return out


def _remove(path: str) -> None:
    """Delete a temporary file at exit if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)

def _local_index_path(storage: Storage) -> str:
    """A local file path for the index: the file itself, or a temp copy of a remote one."""
    if isinstance(storage, LocalStorage):
        path = storage.url_of(INDEX_NAME)
        if not os.path.isfile(path):
            raise DatasetError(f"no index at {path}: rewrite the dataset with `vitscale shards write`")
        return path
    fd, path = tempfile.mkstemp(prefix="vitscale-index-", suffix=".parquet")
    atexit.register(_remove, path)
    try:
        with os.fdopen(fd, "wb") as dst, storage.open_read(INDEX_NAME) as src:
            while chunk := src.read(8 << 20):  # streamed: a JFT-sized index never sits in memory
                dst.write(chunk)
    except FileNotFoundError as exc:
        raise DatasetError(f"no index at {storage.url_of(INDEX_NAME)}") from exc
    return path


@dataclass(frozen=True)
class _IndexSummary:
    counts: Counter[str]
    """Rows per shard of the split."""
    ends: dict[str, int]
    """Per shard, the byte where its last indexed record ends (the shard is at least this long)."""
    has_crc: bool


def _index_summary(path: str, split: str, url: str) -> _IndexSummary:
    """Rows per shard of ``split`` and where their records end, streamed in record batches
    (memory stays flat)."""
    try:
        pf = pq.ParquetFile(path)
        check_index_schema(pf.schema_arrow, url)
        names = set(pf.schema_arrow.names)
        counts: Counter[str] = Counter()
        ends: dict[str, int] = {}
        for batch in pf.iter_batches(columns=["split", "shard", "offset", "size"], batch_size=1 << 20,
                                     use_threads=PARQUET_THREADS):
            mine = pc.equal(batch.column(0), split)
            shards = batch.column(1).filter(mine)
            vc = pc.value_counts(shards)
            counts.update(dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())))
            end = pc.add(batch.column(2).filter(mine), batch.column(3).filter(mine))
            grouped = (pa.table({"shard": shards, "end": end}).group_by("shard", use_threads=PARQUET_THREADS)
                       .aggregate([("end", "max")]))
            for name, e in zip(grouped.column("shard").to_pylist(), grouped.column("end_max").to_pylist()):
                ends[name] = max(ends.get(name, 0), int(e))
        return _IndexSummary(counts, ends, CRC_COLUMN in names)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DatasetError(f"cannot read {url}: {exc}") from exc


def _check_shard_sizes(meta: DatasetMeta, split: str, sizes: dict[str, int], ends: dict[str, int],
                       url: str) -> None:
    """Every shard as long as ``dataset.json`` says, and long enough for its indexed records."""
    bad = []
    for shard in meta.splits[split].shards:
        size = sizes[shard.name]
        if shard.nbytes is not None and size != shard.nbytes:
            bad.append(f"{shard.name} is {size} bytes, {META_NAME} says {shard.nbytes}")
        elif ends.get(shard.name, 0) > size:
            bad.append(f"{shard.name} is {size} bytes, its indexed samples end at byte {ends[shard.name]}")
    if bad:
        raise DatasetError(
            f"{len(bad)} shard(s) of split {split!r} under {url} have the wrong size ({'; '.join(bad[:10])}"
            f"{' ...' if len(bad) > 10 else ''}): truncated or replaced; rewrite or re-copy them"
        )


def open_dataset(url: str, split: str, *, endpoint_url: str | None = None, carve: Carve | None = None) -> OpenDataset:
    """Open and validate ``split`` of the dataset at ``url`` (folder or ``s3://bucket/prefix``).

    Checks, failing with :class:`DatasetError` before any training: ``dataset.json`` is readable and
    lists the split; every listed shard exists with the byte size ``dataset.json`` gives it (and is
    long enough for every record the index places in it); ``_index.parquet`` has the contract's
    columns and, per shard, exactly as many rows as ``dataset.json``'s sample count.
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
    index_storage = storage
    storage = shard_storage(storage, meta, endpoint_url)
    present = storage.list_sizes()
    missing = [n for n in names if n not in present]
    if missing:
        raise DatasetError(
            f"{len(missing)} shard(s) of split {split!r} missing under {storage.url}: "
            f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}"
        )
    if index_storage is storage:
        index_size = present.get(INDEX_NAME)
    else:
        try:
            index_size = index_storage.size(INDEX_NAME)
        except FileNotFoundError:
            index_size = None
    if index_size is None:
        raise DatasetError(f"no index at {index_url}")
    index = IndexFile(index_storage, index_size)  # reads the footer only: O(row groups)
    check_index_schema(index.schema, index_url, labels=meta.extra.get(LABEL_SOURCE) == "index")
    columns = index.columns
    layout = index.layout
    index_path: str | None = None
    if layout is not None:  # per-shard row groups: counts and ends from the footer, rows read lazily
        per_shard = layout.shards(split)
        rows: Counter[str] = Counter({n: r for n, (r, _) in per_shard.items()})
        ends = {n: e for n, (_, e) in per_shard.items()}
    else:
        _warn_legacy(index_url, url)
        index_path = _local_index_path(index_storage)
        summary = _index_summary(index_path, split, index_url)
        rows, ends = summary.counts, summary.ends
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
    _check_shard_sizes(meta, split, present, ends, storage.url)
    if carve is not None:
        if layout is not None:
            groups = [layout.row_groups[(split, n)] for n in names if (split, n) in layout.row_groups]
            keys = index.read_row_groups(groups, ["shard", "key"], whole=False)
        else:
            # The legacy layout: the scanner's filter, as `_read_legacy` reads it (not the whole index decoded).
            keys = pq.read_table(index_path, columns=["shard", "key"], filters=[("split", "=", split)],
                                 use_threads=PARQUET_THREADS)
        carve, counts = _carved_counts(keys, names, carve)
    return OpenDataset(storage, split, meta, names, counts, index, index_path, carve, CRC_COLUMN in columns)


_warned: set[str] = set()


def _warn_legacy(index_url: str, url: str) -> None:
    """Say once per index that it is read whole at every start, and how to rewrite it."""
    if index_url not in _warned:
        _warned.add(index_url)
        log.warning("%s has the legacy layout (row groups across shards): every rank reads all of it at start-up; "
                    "`vitscale shards reindex %s` rewrites it with one row group per shard, read lazily",
                    index_url, url)


def _carved_counts(table: pa.Table, names: tuple[str, ...], carve: Carve) -> tuple[Carve, tuple[int, ...]]:
    """The carve resolved on the split's keys (``table``: its ``shard`` and ``key`` columns), and
    samples per shard in its part. Needs every key of the split: O(samples), carves only."""
    keys = table.column("key").to_pylist()
    carve = carve.resolved(keys)
    selected = carve.select(keys)
    per_shard = Counter(s for s, keep in zip(table.column("shard").to_pylist(), selected) if keep)
    return carve, tuple(per_shard.get(n, 0) for n in names)
