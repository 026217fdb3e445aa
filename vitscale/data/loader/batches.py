"""One rank's batches built whole from its order: what the loader's worker processes run, one epoch or all."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from vitscale.data.corruption import corrupted_positions
from vitscale.data.format import OpenDataset
from vitscale.data.loader.index_cache import IndexCache
from vitscale.data.loader.reader import BadSample, SampleReader
from vitscale.data.loader.sample import decode_sample
from vitscale.data.loader.spec import StreamSpec
from vitscale.data.loader.transforms import sample_rng
from vitscale.data.order import RankOrder, batch_bounds, cycled_batches, rank_order, worker_batches

__all__ = ["EpochBatches", "epoch_order"]


def epoch_order(spec: StreamSpec, counts: Sequence[int], seed: int, epoch: int, position: int) -> RankOrder:
    """Rank ``spec.rank``'s order of ``epoch`` from ``position`` on."""
    return rank_order(counts, seed, epoch, spec.rank, spec.world_size, position, spec.shuffle_buffer,
                      shuffle=spec.train, global_batch=spec.global_batch)


class EpochBatches(IterableDataset):
    """One rank's batches from ``order.start`` of ``order.epoch``: the rest of that epoch, and with ``epochs=None``
    every later epoch whole after it, without end (what one `DataLoader` iterator of a stream reads for all its
    epochs). Later epochs' batches are numbered on from the earlier ones', so worker ``w`` of ``W`` builds batch
    ``n % W == w`` of them all: the order `DataLoader` hands its workers' batches out in, epoch after epoch."""

    def __init__(self, spec: StreamSpec, ds: OpenDataset, order: RankOrder, end: int, epochs: int | None = 1) -> None:
        self.spec, self.ds, self.order, self.end, self.epochs = spec, ds, order, end, epochs
        self.index = IndexCache(ds)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epochs = self.epochs
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        sizes, order, before = self.spec.batch_sizes, self.order, 0  # before: batches of the epochs already built
        reader = SampleReader(self.ds.storage)
        try:
            while True:
                batches = cycled_batches(self.end - order.start, sizes, drop_last=False)
                for b in worker_batches(batches, (worker - before) % workers, workers):
                    lo, hi = batch_bounds(b, sizes)
                    yield self._build(reader, order, order.start + lo, min(order.start + hi, self.end),
                                      shared=info is not None)
                if epochs is not None and order.epoch + 1 == self.order.epoch + epochs:
                    return  # (before the next epoch's order: a large index's takes a while to compute)
                before += batches
                order = epoch_order(self.spec, self.ds.counts, order.seed, order.epoch + 1, 0)
        finally:
            reader.close()

    def _build(self, reader: SampleReader, order: RankOrder, lo: int, hi: int, shared: bool) -> dict[str, Any]:
        ds, tspec = self.ds, self.spec.image_transform
        g = order.global_indices(lo, hi)  # (n,) global sample indices, in emit order
        shard, local = order.locate(g)
        n, r = len(g), tspec.resolution
        entries = self.index.rows_of(shard)
        requests = [
            (ds.shard_names[int(s)], int(e.offsets[i]), int(e.sizes[i]))
            for s, e, i in zip(shard, entries, local)
        ]
        keys = [e.key(int(i)) for e, i in zip(entries, local)]
        crcs = [e.crc(int(i)) for e, i in zip(entries, local)]
        known = [None if e.labels is None else e.labels[int(i)] for e, i in zip(entries, local)]
        raws = reader.read(requests)
        # (n, 3, R, R) uint8 filled in place; in shared memory when a worker process sends it.
        images = torch.empty((n, 3, r, r), dtype=torch.uint8)
        if shared:
            images.share_memory_()
        pixels = images.numpy()
        labels: list[list[int]] = [[] for _ in range(n)]
        valid = np.zeros(n, dtype=bool)
        skipped: list[tuple[str, str, str]] = []
        for i in range(n):
            try:
                rng = sample_rng(order.seed, order.epoch, int(g[i])) if tspec.train else None
                labels[i] = decode_sample(raws[i], keys[i], size=requests[i][2], crc=crcs[i],
                                          num_classes=ds.num_classes, multi_label=ds.multi_label,
                                          spec=tspec, rng=rng, out=pixels[i], labels=known[i])
                valid[i] = True
            except BadSample as exc:
                skipped.append((requests[i][0], keys[i], str(exc)))
        if not valid.all():
            survivors = np.flatnonzero(valid)
            for j, bad in enumerate(np.flatnonzero(~valid).tolist()):
                if survivors.size:  # keep the batch shape: refill with a surviving sample
                    src = int(survivors[j % survivors.size])
                    pixels[bad], labels[bad], keys[bad] = pixels[src], labels[src], keys[src]
                else:
                    pixels[bad], labels[bad] = 0, []  # no sample survived: a blank row, never torch.empty's
        if ds.multi_label:
            label = torch.zeros((n, ds.num_classes), dtype=torch.float32)  # (n, K) multi-hot
            for i, ls in enumerate(labels):
                label[i, ls] = 1.0
        else:
            label = torch.tensor([ls[0] if ls else 0 for ls in labels], dtype=torch.int64)  # (n,)
        batch = {"image": images, "label": label, "key": keys, "valid": torch.from_numpy(valid), "_skipped": skipped,
                 "_count": hi - lo}
        if self.spec.corruption is not None:  # masked patch prediction's plan (data/corruption.py)
            plan = corrupted_positions(order.seed, order.epoch, keys, self.spec.corruption)
            batch["positions"], batch["sources"] = (torch.from_numpy(a) for a in plan)
        return batch
