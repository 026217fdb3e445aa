"""The dataset contract: the one module that names, reads, writes and validates a dataset's files.

A dataset folder (local or ``s3://``) holds ``{split}-{n:06d}.tar`` shards, ``_index.parquet``
(one row per sample: split, shard, key, labels, offset, size, width, height, crc32; ``offset``/``size``
cover the sample's tar members incl. headers and padding, so one ranged read fetches a sample, and
``crc32`` is the ``zlib.crc32`` of those bytes, checked on every read) and
``dataset.json``, the dataset's metadata (name, classes, splits with per-shard sample counts,
SHA-256 and bytes). The index and then ``dataset.json`` are written last: a folder with a
``dataset.json`` is complete.

The index holds one parquet row group per shard, in ``dataset.json`` order, and a layout record
in its footer (:mod:`vitscale.data.format.index`): opening a dataset reads ``dataset.json`` and the
index's footer (O(shards)), and a rank reads only the row groups of the shards it touches, with
ranged reads (an ``s3://`` index is never downloaded whole). Indexes written before this layout
are still read, whole and eagerly (``vitscale shards reindex`` rewrites them).

Each sample is ``{key}.jpg`` plus ``{key}.cls`` (ASCII class index) for single-label data or
``{key}.json`` (``{"labels": [...]}``) for multi-label data.

Every reader and writer (the training stream, the shard writer, stats, verify, dedup, bench) goes
through here: :func:`read_meta` parses ``dataset.json`` into a validated :class:`DatasetMeta`,
:func:`read_index` loads the whole index (tools), :func:`open_dataset` checks one split against its
shards and the index's footer before any training, :func:`write_index_and_meta` writes both files
in that order, and :class:`IndexWriter` streams an index one shard at a time.
"""

from vitscale.data.format.index import IndexFile, IndexWriter, index_bytes, write_index_and_meta
from vitscale.data.format.meta import (
    CRC_COLUMN,
    DEFAULT_SPLIT,
    FORMAT,
    INDEX_COLUMNS,
    INDEX_NAME,
    INDEX_SCHEMA,
    LABEL_SOURCE,
    META_NAME,
    SHARD_ROOT,
    SPLIT_NAME,
    SPLIT_WORDS,
    DatasetError,
    DatasetMeta,
    ShardMeta,
    SplitMeta,
    check_index_schema,
    has_dataset,
    no_dataset,
    read_index,
    read_meta,
    shard_name,
    shard_splits,
    shard_storage,
    split_of_shard,
)
from vitscale.data.format.split import OpenDataset, ShardIndex, open_dataset

__all__ = [
    "CRC_COLUMN", "DEFAULT_SPLIT", "FORMAT", "INDEX_COLUMNS", "INDEX_NAME", "INDEX_SCHEMA", "LABEL_SOURCE", "META_NAME",
    "SHARD_ROOT", "SPLIT_NAME", "SPLIT_WORDS",
    "DatasetError", "DatasetMeta", "IndexFile", "IndexWriter",
    "OpenDataset", "ShardIndex", "ShardMeta", "SplitMeta", "check_index_schema", "has_dataset", "index_bytes",
    "no_dataset",
    "open_dataset", "read_index", "read_meta", "shard_name", "shard_splits", "shard_storage", "split_of_shard",
    "write_index_and_meta",
]
