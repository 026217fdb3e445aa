"""``_index.parquet`` laid out for start-up in O(shards): one row group per shard, read lazily.

Layout. :class:`IndexWriter` writes the index one shard at a time, each shard's rows (in tar
order) as exactly one parquet row group, in ``dataset.json`` order, and records the layout in the
file's key-value metadata under :data:`LAYOUT_KEY`: per row group its split, shard, row count and
the byte where the shard's last record ends. The file stays an ordinary parquet file with the
contract's schema (``pq.read_table``, pandas and DuckDB read it whole as before).

Reading. :class:`IndexFile` reads the index through the dataset's :class:`~vitscale.data.storage.Storage`
with ranged reads (``read_range``): the footer once per process (row groups, schema and the layout
record: O(shards)), then only the row groups asked for, so an ``s3://`` index is never downloaded
whole: ``OpenDataset.load_index(shards)`` reads just those shards' row groups (the training
stream asks for the shards each batch reaches and keeps a bounded cache of them:
:class:`vitscale.data.loader.index_cache.IndexCache`).

An index without a valid layout record (written before it existed, or rewritten by another tool)
is the *legacy* layout: still read, eagerly and whole at open, as before (``vitscale shards
reindex DEST`` rewrites it in this layout).
"""

from __future__ import annotations

import io
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vitscale.data.format.meta import (
    INDEX_NAME,
    INDEX_SCHEMA,
    META_NAME,
    PARQUET_THREADS,
    DatasetError,
    DatasetMeta,
    read_index,
    read_meta,
)
from vitscale.data.storage import Storage, StorageError
from vitscale.data.storage.base import ObjectReader

__all__ = ["LAYOUT_KEY", "IndexFile", "IndexLayout", "IndexWriter", "index_bytes", "reindex"]

LAYOUT_KEY = "vitscale.index"
"""Key-value metadata key of the layout record (JSON: ``{"layout": "row-group-per-shard",
"version": 1, "row_groups": [[split, shard, rows, end], ...]}``, one entry per row group)."""
_LAYOUT = "row-group-per-shard"
_VERSION = 1
_STATISTICS = ["split", "shard"]
"""Columns with min/max statistics (others' would grow the footer by a third and serve no reader)."""
_DICTIONARY = ("split", "shard", "labels", "width", "height")
"""Columns dictionary-encoded: few distinct values. Keys, offsets, sizes and checksums are unique
per row; a dictionary of them costs a fifth more bytes in a shard-sized row group."""
_COMPRESSION = "zstd"
"""About 19 bytes a sample against snappy's 31 (a 16-character key, one label, offset, size,
width, height, crc32); any parquet reader of the last years reads it."""

# --------------------------------------------------------------------------- writing


class IndexWriter:
    """Streams ``_index.parquet``, one shard (one row group) at a time, memory bounded by a shard.

    ``where``: a local path or a binary file object; ``schema``: the contract's (default), or an
    index's own (``reindex`` keeps a third-party index's columns). Call :meth:`write_shard` per
    shard in ``dataset.json`` order, then :meth:`close` (which writes the layout record and the footer).
    """

    def __init__(self, where: str | os.PathLike[str] | BinaryIO, schema: pa.Schema = INDEX_SCHEMA) -> None:
        sink = os.fspath(where) if isinstance(where, (str, os.PathLike)) else where
        self.schema = schema.remove_metadata()
        self._writer = pq.ParquetWriter(sink, self.schema, write_statistics=_STATISTICS, compression=_COMPRESSION,
                                        use_dictionary=[c for c in _DICTIONARY if c in self.schema.names])
        self._groups: list[list[Any]] = []
        self._seen: set[tuple[str, str]] = set()

    def write_shard(self, split: str, shard: str, columns: pa.Table | Mapping[str, Any]) -> None:
        """The rows of one shard: ``columns`` maps index columns to arrays (``split``/``shard`` may be
        left out; other optional ones are null when absent). Rows are written in offset (tar) order."""
        if (split, shard) in self._seen:
            raise ValueError(f"index rows of shard {shard} ({split}) written twice")
        self._seen.add((split, shard))
        table = _conform(split, shard, columns, self.schema)
        n = table.num_rows
        if n == 0:
            return  # no row group: a shard without samples has no rows (dataset.json says 0)
        offsets = table.column("offset").to_numpy()
        if n > 1 and (np.diff(offsets) < 0).any():
            table = table.take(pa.array(np.argsort(offsets, kind="stable")))
            offsets = table.column("offset").to_numpy()
        end = int(np.max(offsets + table.column("size").to_numpy()))
        self._writer.write_table(table, row_group_size=n)
        self._groups.append([split, shard, n, end])

    def close(self) -> None:
        record = {"layout": _LAYOUT, "version": _VERSION, "row_groups": self._groups}
        self._writer.add_key_value_metadata({LAYOUT_KEY: json.dumps(record, separators=(",", ":"))})
        self._writer.close()


def _conform(split: str, shard: str, columns: pa.Table | Mapping[str, Any], schema: pa.Schema) -> pa.Table:
    """``columns`` as a table of ``schema``, every row in ``split``/``shard``."""
    cols = {name: columns.column(name) for name in columns.column_names} if isinstance(columns, pa.Table) \
        else dict(columns)
    n = len(cols["key"])
    for name, value in (("split", split), ("shard", shard)):
        given = cols.get(name)
        if given is not None and n and not pc.all(pc.equal(_as_array(given, pa.string()), value)).as_py():
            raise ValueError(f"rows given for shard {shard} ({split}) name another {name}")
        cols[name] = pa.repeat(pa.scalar(value, pa.string()), n)
    arrays = [_as_array(cols[f.name], f.type) if f.name in cols else pa.nulls(n, f.type) for f in schema]
    return pa.table(arrays, schema=schema)


def _as_array(value: Any, kind: pa.DataType) -> pa.Array | pa.ChunkedArray:
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        return value if value.type == kind else value.cast(kind)
    return pa.array(value, type=kind)


def index_bytes(table: pa.Table, meta: DatasetMeta) -> bytes:
    """``_index.parquet`` in the per-shard layout for ``table`` (an index's rows, any order, its
    columns kept): shards in ``meta``'s order, then any shard ``meta`` does not list (in order of
    appearance)."""
    buf = io.BytesIO()
    writer = IndexWriter(buf, table.schema)
    for split, shard, rows in _grouped(table, meta):
        writer.write_shard(split, shard, rows)
    writer.close()
    return buf.getvalue()


def _grouped(table: pa.Table, meta: DatasetMeta) -> Iterator[tuple[str, str, pa.Table]]:
    """(split, shard, its rows) in ``meta``'s shard order, then the shards it does not list (in order
    of appearance). Grouped on dictionary codes: no Python object per row."""
    if table.num_rows == 0:
        return
    splits = pc.dictionary_encode(table.column("split").combine_chunks())
    shards = pc.dictionary_encode(table.column("shard").combine_chunks())
    if splits.null_count or shards.null_count:
        raise ValueError("index rows without a split or shard")
    width = len(shards.dictionary)
    key = splits.indices.to_numpy().astype(np.int64) * width + shards.indices.to_numpy()
    order = np.argsort(key, kind="stable")
    groups, starts = np.unique(key[order], return_index=True)
    bounds = np.append(starts, len(order))
    split_names, shard_names = splits.dictionary.to_pylist(), shards.dictionary.to_pylist()
    names = [(str(split_names[k // width]), str(shard_names[k % width])) for k in groups.tolist()]
    listed = {(s, sh.name): i for i, (s, sh) in enumerate((s, sh) for s, sp in meta.splits.items() for sh in sp.shards)}
    first = order[starts]  # each group's first row: its place of appearance
    for g in sorted(range(len(names)), key=lambda g: (listed.get(names[g], len(listed)), int(first[g]))):
        yield names[g][0], names[g][1], table.take(pa.array(order[bounds[g] : bounds[g + 1]]))


# --------------------------------------------------------------------------- reading


class _RangeFile(ObjectReader):
    """A read-only, seekable file over one storage object: a read inside ``prefetched`` is served
    from it, any other is one ``read_range``."""

    def __init__(self, storage: Storage, name: str, size: int) -> None:
        super().__init__(size)
        self._storage, self._name = storage, name
        self.prefetched: list[tuple[int, bytes]] = []
        """(start, bytes) spans already read (a row group's column chunks, read in one request)."""

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            n = self._size - self._pos
        n = max(0, min(n, self._size - self._pos))
        for start, blob in self.prefetched:
            if start <= self._pos and self._pos + n <= start + len(blob):
                data = blob[self._pos - start : self._pos - start + n]
                break
        else:
            data = self._storage.read_range(self._name, self._pos, n) if n else b""
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


@dataclass(frozen=True)
class IndexLayout:
    """The layout record of a per-shard index, checked against the file's row groups."""

    row_groups: dict[tuple[str, str], int]
    """(split, shard) -> its row group."""
    rows: dict[tuple[str, str], int]
    """(split, shard) -> its row count."""
    ends: dict[tuple[str, str], int]
    """(split, shard) -> the byte where its last record ends."""

    def shards(self, split: str) -> dict[str, tuple[int, int]]:
        """Shard name -> (rows, end) of the shards of ``split`` with rows."""
        return {sh: (n, self.ends[(s, sh)]) for (s, sh), n in self.rows.items() if s == split}


def _parse_layout(raw: bytes | None, md: pq.FileMetaData) -> IndexLayout | None:
    """The layout record if there is one and it matches the row groups (else None: legacy)."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        if record.get("layout") != _LAYOUT or record.get("version") != _VERSION:
            return None
        groups = record["row_groups"]
        if len(groups) != md.num_row_groups:
            return None
        row_groups, rows, ends = {}, {}, {}
        for g, (split, shard, n, end) in enumerate(groups):
            key = (str(split), str(shard))
            if key in row_groups or md.row_group(g).num_rows != int(n):
                return None
            row_groups[key], rows[key], ends[key] = g, int(n), int(end)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return IndexLayout(row_groups, rows, ends)


class IndexFile:
    """A dataset's ``_index.parquet`` read with ranged reads through its storage: the footer once per
    process, then row groups on demand. Pickles without its open state (a worker reads the footer
    again)."""

    def __init__(self, storage: Storage, size: int, name: str = INDEX_NAME) -> None:
        self.storage, self.size, self.name = storage, int(size), name
        self.url = storage.url_of(name)
        self._file: pq.ParquetFile | None = None
        self._source: _RangeFile | None = None
        self._pid = -1
        self._layout: IndexLayout | None = None
        self._layout_read = False
        self._lock = threading.Lock()  # one parquet reader per process, used by one thread at a time

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_file=None, _source=None, _pid=-1, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _parquet(self) -> pq.ParquetFile:
        if self._file is None or self._pid != os.getpid():  # after a fork: a fresh reader, same footer
            metadata = self._file.metadata if self._file is not None else None
            source = _RangeFile(self.storage, self.name, self.size)
            self._file = self._call(lambda: pq.ParquetFile(source, metadata=metadata))
            self._source, self._pid = source, os.getpid()
        return self._file

    def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, an unreadable file a :class:`DatasetError` naming it (storage failures stay what they are)."""
        try:
            return fn()
        except (StorageError, DatasetError):  # a DatasetError names the file already
            raise
        except FileNotFoundError as exc:
            raise DatasetError(f"no index at {self.url}") from exc
        except (OSError, pa.ArrowException, ValueError) as exc:
            raise DatasetError(f"cannot read {self.url}: {exc}") from exc

    @property
    def metadata(self) -> pq.FileMetaData:
        return self._parquet().metadata

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    @property
    def schema(self) -> pa.Schema:
        return self._parquet().schema_arrow

    @property
    def layout(self) -> IndexLayout | None:
        """The per-shard layout, or None for a legacy index (see the module docstring)."""
        if not self._layout_read:
            md = self.metadata
            self._layout = _parse_layout((md.metadata or {}).get(LAYOUT_KEY.encode()), md)
            self._layout_read = True
        return self._layout

    def read_row_groups(self, groups: Sequence[int], columns: Sequence[str], *, whole: bool = True) -> pa.Table:
        """The rows of ``groups`` (in that order), ``columns`` only. ``whole``: one ranged read per
        run of adjacent row groups (all their column chunks: one request per shard, not one per
        column; for a few shards); else pyarrow reads just ``columns``' chunks (a scan of many)."""
        with self._lock:
            pf = self._parquet()
            spans: list[list[int]] = []
            for lo, hi in sorted(_extent(pf.metadata, g) for g in set(groups) if whole):
                if spans and lo <= spans[-1][1]:
                    spans[-1][1] = max(spans[-1][1], hi)
                else:
                    spans.append([lo, hi])
            source = self._source
            if source is None:
                raise RuntimeError("the index file is not open")
            try:
                for lo, hi in spans:
                    source.prefetched.append((lo, self._call(partial(self.storage.read_range, self.name, lo,
                                                                     hi - lo))))
                return self._call(lambda: pf.read_row_groups(list(groups), columns=list(columns),
                                                             use_threads=PARQUET_THREADS))
            finally:
                source.prefetched = []


def _extent(md: pq.FileMetaData, group: int) -> tuple[int, int]:
    """Bytes ``[start, end)`` of row group ``group``'s column chunks."""
    rg = md.row_group(group)
    lo, hi = 1 << 62, 0
    for c in range(rg.num_columns):
        col = rg.column(c)
        start = col.dictionary_page_offset if col.has_dictionary_page and col.dictionary_page_offset else \
            col.data_page_offset
        lo, hi = min(lo, start), max(hi, start + col.total_compressed_size)
    return lo, hi


def reindex(url: str, *, endpoint_url: str | None = None) -> dict[str, Any]:
    """Rewrite the ``_index.parquet`` of the dataset at ``url`` in the per-shard layout (``vitscale
    shards reindex``); an index already in it is left alone. Reads the whole index once; its rows,
    columns and values and ``dataset.json`` stay as they are."""
    from vitscale.data.storage import open_storage

    storage = open_storage(url, endpoint_url=endpoint_url)
    meta = read_meta(storage)
    try:
        size = storage.size(INDEX_NAME)
    except FileNotFoundError as exc:
        raise DatasetError(f"no index at {storage.url_of(INDEX_NAME)}") from exc
    before = IndexFile(storage, size)
    if before.layout is not None:
        return {"index": before.url, "rewritten": False, "row_groups": before.metadata.num_row_groups,
                "rows": before.metadata.num_rows}
    table = before._call(lambda: read_index(storage))  # its columns checked (`check_index_schema`)
    storage.write_bytes(INDEX_NAME, index_bytes(table, meta))
    after = IndexFile(storage, storage.size(INDEX_NAME))
    if after.layout is None or after.metadata.num_rows != table.num_rows:
        raise DatasetError(f"{after.url}: the rewritten index does not read back; write the dataset again")
    return {"index": after.url, "rewritten": True, "row_groups": after.metadata.num_row_groups,
            "rows": table.num_rows}


def write_index_and_meta(storage: Storage, rows: list[dict[str, Any]], meta: DatasetMeta) -> None:
    """Write ``_index.parquet`` (one row group per shard, in ``meta``'s order) then ``dataset.json`` (last:
    its presence marks a complete set)."""
    storage.write_bytes(INDEX_NAME, index_bytes(pa.Table.from_pylist(rows, schema=INDEX_SCHEMA), meta))
    storage.write_bytes(META_NAME, (json.dumps(meta.to_json(), indent=2) + "\n").encode())
