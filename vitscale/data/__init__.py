"""Datasets for pre-training: the shard format, where it is stored, the sample order, the training
loader and the offline tools.

- :mod:`vitscale.data.format`: the dataset contract (``dataset.json``, ``_index.parquet``, shard
  names), read, written and validated in one place;
- :mod:`vitscale.data.storage`: local folders and ``s3://`` behind one interface;
- :mod:`vitscale.data.order`: which rank reads which sample when (pure numpy);
- :mod:`vitscale.data.loader`: the training loader (ranged reads, decode, augmentation, batches);
- :mod:`vitscale.data.tools`: offline tools behind ``vitscale shards`` (write, verify, stats,
  dedup, bench).
"""
