"""Index rows (offsets, sizes, keys, labels) of the shards a rank's batches reach, loaded on demand."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from vitscale.data.format import OpenDataset, ShardIndex

__all__ = ["IndexCache"]


class IndexCache:
    """Index rows of the shards a rank's batches reach, loaded as they reach them (one read per new
    shard set) and dropped least-recently-used past ``keep`` shards: memory is bounded by the shards
    of a window or two, not by the dataset, which a global-batch epoch visits whole on every rank."""

    def __init__(self, ds: OpenDataset, keep: int = 64) -> None:
        self.ds, self.keep = ds, keep
        self.rows: OrderedDict[int, ShardIndex] = OrderedDict()

    def rows_of(self, shards: np.ndarray) -> list[ShardIndex]:
        wanted = [int(s) for s in shards]
        missing = {s for s in wanted if s not in self.rows}
        if missing:
            self.rows.update(self.ds.load_index(missing))
        for s in dict.fromkeys(wanted):
            self.rows.move_to_end(s)
        out = [self.rows[s] for s in wanted]
        while len(self.rows) > self.keep:
            self.rows.popitem(last=False)
        return out
