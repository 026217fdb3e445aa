"""The shard stream as a ``torch.utils.data.IterableDataset`` for one's own training loop.

    from torch.utils.data import DataLoader
    from vitscale.data import ShardDataset

    ds = ShardDataset("data/mine", "train", batch_size=64, resolution=224,
                      transform=lambda hwc: torch.from_numpy(hwc).permute(2, 0, 1).float() / 255)
    for batch in DataLoader(ds, batch_size=None, num_workers=2):   # batches are built whole
        x, y = batch["image"], batch["label"]                      # (64, 3, 224, 224), (64,)
        ...
        checkpoint["data"] = batch["state"]                        # where the next batch starts

    ds.load_state_dict(checkpoint["data"])                          # resume: exactly the rest

It is :class:`~vitscale.data.loader.stream.ShardStream`'s order and batches (the same
:func:`~vitscale.data.order.rank_order`, ranged reads, seeded crops: a resumed run sees the
bit-identical remaining batches, whatever the number of DataLoader workers), handed to a
``DataLoader`` of the user's. Pass ``batch_size=None`` to the ``DataLoader``: the dataset builds
whole batches, worker ``w`` of ``W`` building batches ``b % W == w``, which is the order a
``DataLoader`` hands batches out in.

A batch is a dict: ``image`` (the transform's outputs stacked, or uint8 (B, 3, R, R) without a
transform), ``label`` int64 (B,) or float32 multi-hot (B, K), ``key`` list[str], ``valid`` bool
(B,) (False for rows refilled after a skipped, damaged sample), and ``state``: the stream state
after this batch, to save with a checkpoint and give to :meth:`ShardDataset.load_state_dict`.
Each iteration runs the rest of the current epoch; :meth:`ShardDataset.set_epoch` starts another
(shuffled anew from ``(seed, epoch)``).

The ``transform`` hook gets each image after vitscale's crop (training: a random-resized crop and
flip seeded by (seed, epoch, sample); evaluation: the centre crop) as a contiguous uint8
(R, R, 3) RGB array and returns a tensor (every sample's the same shape). It runs in the
DataLoader worker; randomness in it is the user's, outside vitscale's exact resume.

Damaged samples are skipped and logged; the error budget (``error_budget``, a fraction of the
epoch's samples) is checked by each process on the batches it builds: past it, the iteration raises
``ErrorBudgetExceeded`` naming the shards that process skipped samples of. DataLoader workers do not see
each other's counts, so with W workers an epoch may skip up to W times the budget before one raises.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from vitscale.data.loader.budget import budget_error
from vitscale.data.loader.stream import ShardStream, StreamSpec
from vitscale.data.order import worker_batches

__all__ = ["ShardDataset", "Transform"]

log = logging.getLogger(__name__)

Transform = Callable[[np.ndarray], torch.Tensor]
"""uint8 (H, W, 3) RGB array in, tensor out."""


class ShardDataset(IterableDataset):
    """Batches of a vitscale dataset (``dataset.json`` + ``_index.parquet`` + shards, local or ``s3://``).

    ``rank``/``world_size``: this process's share of each epoch (disjoint, equal-length per rank).
    ``train=False``: dataset order, centre crop, the last partial batch kept. Other arguments as
    :class:`~vitscale.data.loader.stream.ShardStream`'s.
    """

    def __init__(self, url: str | StreamSpec, split: str = "train", *, transform: Transform | None = None,
                 **fields: Any) -> None:
        """``ShardDataset(url, split, **fields)`` with :class:`~vitscale.data.loader.stream.StreamSpec`'s fields
        (``batch_size``, ``resolution``, ``train``, ``seed``, ``rank``, ``world_size``, ...), or a whole
        ``StreamSpec``. ``transform``: a callable applied to each decoded uint8 (H, W, 3) image instead of
        the loader's own tensor conversion. Decoding runs in the ``DataLoader`` this is wrapped in, so the
        stream's own ``num_workers`` must stay 0."""
        super().__init__()
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be a callable (uint8 HWC array -> tensor), got {transform!r}")
        self.stream = ShardStream(url, split, **fields) if not isinstance(url, StreamSpec) else ShardStream(url)
        if self.stream.spec.num_workers:
            raise ValueError(f"num_workers={self.stream.spec.num_workers}: a ShardDataset decodes in the DataLoader "
                             "it is wrapped in; set num_workers there")
        self.transform = transform

    @property
    def classes(self) -> tuple[str, ...]:
        """Class names (label ``i`` is ``classes[i]``)."""
        return tuple(self.stream.dataset.meta.classes)

    @property
    def num_classes(self) -> int:
        return int(self.stream.dataset.num_classes)

    def __len__(self) -> int:
        """Batches left in the current epoch (what one iteration yields)."""
        return len(self.stream)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first sample on the next iteration."""
        self.stream.set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """Where the next iteration starts (``epoch``, ``position``, ``seed``). Iterated in this process
        (``num_workers=0``) it follows the batches handed out; with DataLoader workers, save the last
        batch's ``state`` instead."""
        return {k: v for k, v in self.stream.state_dict().items() if k != "skipped"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (a batch's ``state`` or :meth:`state_dict`): the next iteration yields
        exactly the batches that followed it."""
        self.stream.load_state_dict(state)

    def _state_after(self, epoch: int, position: int) -> dict[str, int]:
        if position >= self.stream.epoch_end:
            return {"epoch": epoch + 1, "position": 0, "seed": self.stream.seed}
        return {"epoch": epoch, "position": position, "seed": self.stream.seed}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        stream = self.stream
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        epoch, start, bs = stream.epoch, stream.position, stream.spec.batch_size
        # The batch indices the source yields, in its order: the same pure function it runs.
        numbers = worker_batches(len(stream), worker, workers)
        skipped: Counter[str] = Counter()  # this process's skipped samples in this iteration, by shard
        budget = stream.budget_samples()
        for b, batch in zip(numbers, stream.epoch_batches()):
            for shard, key, why in batch.pop("_skipped"):
                skipped[shard] += 1
                log.warning("skipped sample %s in %s: %s", key, shard, why)
            if skipped.total() > budget:
                raise budget_error(skipped.total(), epoch, stream.spec.error_budget, sum(stream.dataset.counts), 1,
                                   [skipped])
            count = batch.pop("_count")
            state = self._state_after(epoch, start + b * bs + count)
            batch["image"] = self._apply(batch["image"])
            batch["state"] = state
            if info is None:  # iterated here: the dataset's own state follows the batches handed out
                stream.epoch, stream.position = state["epoch"], state["position"]
            yield batch

    def _apply(self, images: torch.Tensor) -> torch.Tensor:
        """The user transform on each (R, R, 3) uint8 image of a (B, 3, R, R) batch, stacked."""
        transform = self.transform
        if transform is None:
            return images
        outs = []
        for chw in images:
            out = transform(np.ascontiguousarray(chw.permute(1, 2, 0).numpy()))
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"transform must return a torch.Tensor, got {type(out).__name__}")
            outs.append(out)
        return torch.stack(outs)
