"""Datasets for pre-training: the shard format, where it is stored, the sample order, the training
loader and the offline tools.

- :mod:`vitscale.data.format`: the dataset contract (``dataset.json``, ``_index.parquet``, shard
  names), read, written and validated in one place;
- :mod:`vitscale.data.storage`: local folders and ``s3://`` behind one interface;
- :mod:`vitscale.data.order`: which rank reads which sample when (pure numpy);
- :mod:`vitscale.data.loader`: the training loader (ranged reads, decode, augmentation, batches);
- :mod:`vitscale.data.tools`: offline tools behind ``vitscale shards`` (write, verify, stats,
  dedup, bench) and the image sources (:mod:`vitscale.data.tools.sources`, the source registry).

The public API (docs/api.md), imported on first use (``import vitscale.data.format`` loads no torch):
:class:`ShardDataset` (the stream as a torch ``IterableDataset``), :class:`DatasetWriter` (one's own
samples as a dataset), :func:`rank_order`, :class:`ShardStream`, :func:`open_dataset`,
:func:`open_source`, :func:`write_dataset`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vitscale.data.dataset import ShardDataset
    from vitscale.data.format import open_dataset
    from vitscale.data.loader.stream import ShardStream
    from vitscale.data.order import rank_order
    from vitscale.data.tools.sources import open_source
    from vitscale.data.tools.write import write_dataset
    from vitscale.data.writer import DatasetWriter

_EXPORTS: dict[str, str] = {
    "ShardDataset": "vitscale.data.dataset",
    "DatasetWriter": "vitscale.data.writer",
    "rank_order": "vitscale.data.order",
    "ShardStream": "vitscale.data.loader.stream",
    "open_dataset": "vitscale.data.format",
    "open_source": "vitscale.data.tools.sources",
    "write_dataset": "vitscale.data.tools.write",
}
"""Public name -> the module that defines it."""

__all__ = ["DatasetWriter", "ShardDataset", "ShardStream", "open_dataset", "open_source", "rank_order",
           "write_dataset"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vitscale.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
