"""The training loader: this rank's samples, in :mod:`vitscale.data.order`'s order, as uint8 batches.

``ShardStream`` reads a dataset written by ``vitscale shards write`` (``dataset.json``,
``_index.parquet``, ``{split}-NNNNNN.tar``; see :mod:`vitscale.data.format`) from a folder or
``s3://``:

- the order is :func:`vitscale.data.order.rank_order`'s: disjoint, equal-length per rank,
  reshuffled per epoch, resumable at any sample; with ``global_batch`` each step's samples are the
  same at any world size, dividing it or not (elastic training; ``data.order.micro_batch_sizes``);
- each sample is fetched with a ranged read of its bytes (offsets from the index), so a rank reads
  only its own samples; with ``num_workers`` loader processes, batch ``b`` is built whole by worker
  ``b % num_workers``, which is the order ``DataLoader`` hands batches out, so the emitted order is
  the same whatever the worker count;
- augmentation draws from ``sample_rng(seed, epoch, global index)``: a resumed stream yields
  bit-identical batches.

Epochs. Iterating the stream yields the rest of the current epoch (``len(stream)`` batches) and
then stops; the epoch counter advances as the epoch's last batch is handed out, so the next ``for``
loop runs the next epoch and a checkpoint taken after the last batch resumes at the next epoch's
start. ``set_epoch(e)`` jumps to the start of epoch ``e``. ``state_dict()`` counts every batch
already handed out (``position`` = samples of this epoch consumed by this rank).

Bad samples (truncated tar, corrupt JPEG, missing/malformed label) are skipped, counted per shard
(:meth:`ShardStream.skipped`) and logged once with shard and key. Every rank still emits the same
number of batches of the same shape: a batch that lost samples refills those rows with copies of
its surviving samples and marks them ``valid=False`` (a batch that lost all its samples is zeros,
label 0, all ``valid=False``).

Error budget. ``error_budget`` is a fraction of the epoch's samples across all ranks (the split's
sample count): ``0.001`` lets 0.1% of them be skipped in an epoch, ``1.0`` lets all of them, ``0``
none. One more skipped sample raises :class:`ErrorBudgetExceeded` naming the shards. A single
rank checks after every batch. With several ranks no rank knows the others' count, so the caller
sums :meth:`ShardStream.epoch_skipped` over the ranks once per step and passes the sum to
:meth:`ShardStream.check_error_budget` (``train/loop.py`` does), so every rank stops at the same
step rather than one rank leaving the others waiting in a collective. The count so far in the
epoch travels in :meth:`ShardStream.state_dict` (``skipped``) into checkpoints: a restart resumes
it, never resets it.
A missing shard, an unreadable ``dataset.json``/index or an index that disagrees with
``dataset.json`` raises :class:`~vitscale.data.format.DatasetError` in the constructor, before any
training step.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vitscale.config.checks import check, fraction, non_negative, positive_int
from vitscale.data.carve import Carve
from vitscale.data.config import DEFAULT_ERROR_BUDGET, MAX_LOADER_WORKERS
from vitscale.data.corruption import Corruption, corrupted_positions
from vitscale.data.format import DatasetError, OpenDataset, open_dataset
from vitscale.data.loader.budget import ErrorBudgetExceeded, budget_error
from vitscale.data.loader.index_cache import IndexCache
from vitscale.data.loader.reader import BadSample, SampleReader
from vitscale.data.loader.sample import decode_sample
from vitscale.data.loader.transforms import TransformSpec, sample_rng
from vitscale.data.order import (
    DEFAULT_SHUFFLE_BUFFER,
    RankOrder,
    batch_bounds,
    cycled_batches,
    micro_batch_sizes,
    rank_order,
    samples_per_rank,
    worker_batches,
)

__all__ = ["ErrorBudgetExceeded", "ShardStream", "StreamSpec"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSpec:
    """Everything that decides a stream's content (see :class:`ShardStream`)."""

    url: str
    """Dataset folder or ``s3://bucket/prefix``."""
    split: str = "train"
    rank: int = 0
    """This process's rank among ``world_size`` data-parallel ranks."""
    world_size: int = 1
    seed: int = 0
    """Seeds shard order, sample shuffle and augmentation (with the epoch)."""
    batch_size: int = 64
    """Per-rank batch size (with ``global_batch``: the largest; see :attr:`batch_sizes`)."""
    global_batch: int | None = None
    """Samples per optimizer step, all ranks: each rank takes its share of every global batch, so a step's
    samples do not depend on ``world_size`` (training). None: one contiguous span per rank."""
    train: bool = True
    """Shuffled order + random augmentation; False: dataset order + centre crop."""
    num_workers: int = 0
    """DataLoader worker processes decoding for this rank (0: decode in this process)."""
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER
    """Window of the in-span sample shuffle (samples)."""
    error_budget: float = DEFAULT_ERROR_BUDGET
    """Skipped samples allowed per epoch, as a fraction of the epoch's samples across all ranks
    (1.0: all of them)."""
    endpoint_url: str | None = None
    """S3-protocol endpoint (MinIO, moto, Ceph); None: environment, then AWS."""
    resolution: int = 224
    """Side of the square images the stream emits (the transform's output)."""
    drop_last: bool | None = None
    """Drop the epoch's last partial batch; None: as ``train`` (training drops it, evaluation keeps it)."""
    transform: TransformSpec | None = None
    """Crop/flip of each image; None: the standard one (`TransformSpec`) for ``resolution`` and ``train``."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead."""
    pin_memory: bool = False
    """Page-lock batches for faster, asynchronous host-to-GPU copies."""
    corruption: Corruption | None = None
    """Masked patch prediction: each sample's corrupted patches (``positions``, ``sources``) from
    :func:`vitscale.data.corruption.corrupted_positions` of (seed, epoch, key); None: not computed."""

    def __post_init__(self) -> None:
        # Resolved once here, so every reader of a spec sees whole values (frozen: set through object).
        if self.transform is None:
            object.__setattr__(self, "transform", TransformSpec(resolution=self.resolution, train=self.train))
        elif self.transform.resolution != self.resolution or self.transform.train != self.train:
            raise ValueError("transform.resolution/train must match resolution/train")
        if self.drop_last is None:
            object.__setattr__(self, "drop_last", self.train)
        positive_int(self.world_size, "world_size")
        check(0 <= self.rank < self.world_size, "rank", f"must be in [0, {self.world_size}) (world_size): {self.rank}")
        positive_int(self.batch_size, "batch_size")
        positive_int(self.world_size if self.global_batch is None else self.global_batch, "global_batch")
        check(min(self.batch_sizes) > 0, "batch_size", f"{self.batch_size}: rank {self.rank}'s share of "
              f"global_batch={self.global_batch} cannot fill the {len(self.batch_sizes)} batches every rank cuts")
        non_negative(self.num_workers, "num_workers")
        check(self.num_workers <= MAX_LOADER_WORKERS, "num_workers",
              f"at most {MAX_LOADER_WORKERS} loader processes, got {self.num_workers}")
        fraction(self.error_budget, "error_budget")
        non_negative(self.seed, "seed")
        positive_int(self.shuffle_buffer, "shuffle_buffer")
        positive_int(self.prefetch_factor, "prefetch_factor")

    @property
    def image_transform(self) -> TransformSpec:
        """`transform`, resolved in `__post_init__` (never None once built)."""
        return cast(TransformSpec, self.transform)

    @property
    def drops_last(self) -> bool:
        """`drop_last`, resolved in `__post_init__` (never None once built)."""
        return bool(self.drop_last)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Consecutive batches' sizes, repeated from the start: ``(batch_size,)``, or one step's micro-batches."""
        return micro_batch_sizes(self.global_batch, self.world_size, self.rank, self.batch_size)


class _EpochBatches(IterableDataset):
    """One epoch of one rank from ``order.start``: worker ``w`` builds batches ``b % W == w``."""

    def __init__(self, spec: StreamSpec, ds: OpenDataset, order: RankOrder, end: int) -> None:
        self.spec, self.ds, self.order, self.end = spec, ds, order, end
        self.index = IndexCache(ds)
        self.batches = cycled_batches(end - order.start, spec.batch_sizes, drop_last=False)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        start, sizes = self.order.start, self.spec.batch_sizes
        reader = SampleReader(self.ds.storage)
        try:
            for b in worker_batches(self.batches, worker, workers):
                lo, hi = batch_bounds(b, sizes)
                yield self._build(reader, start + lo, min(start + hi, self.end), shared=info is not None)
        finally:
            reader.close()

    def _build(self, reader: SampleReader, lo: int, hi: int, shared: bool) -> dict[str, Any]:
        ds, tspec = self.ds, self.spec.image_transform
        g = self.order.global_indices(lo, hi)  # (n,) global sample indices, in emit order
        shard, local = self.order.locate(g)
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
                rng = sample_rng(self.order.seed, self.order.epoch, int(g[i])) if tspec.train else None
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
            plan = corrupted_positions(self.order.seed, self.order.epoch, keys, self.spec.corruption)
            batch["positions"], batch["sources"] = (torch.from_numpy(a) for a in plan)
        return batch


class ShardStream:
    """This rank's batches of a sharded dataset; see the module docstring for the guarantees.

    Batches are dicts: ``image`` uint8 (B, 3, R, R) contiguous (normalise on the device with
    :func:`vitscale.data.loader.transforms.normalize_on_device`), ``label`` int64 (B,) or, for multi-label
    datasets, float32 multi-hot (B, K), ``key`` list[str], ``valid`` bool (B,) (False only for rows
    refilled after a skipped sample); with a ``corruption``, ``positions`` int64 (B, corrupted) and
    ``sources`` int64 (B, swapped) (:mod:`vitscale.data.corruption`). ``train=False`` gives the centre-crop
    evaluation transform, no shuffling, and keeps the last partial batch (``drop_last`` defaults to ``train``).
    """

    def __init__(self, url: str | StreamSpec, split: str = "train", *, carve: Carve | None = None,
                 **fields: Any) -> None:
        """``ShardStream(spec)``, or ``ShardStream(url, split, **fields)`` with `StreamSpec`'s fields (the one
        list of loader settings: a new one is added there alone). ``carve`` reads one part (dev or rest)
        of a carve of the split instead of all of it."""
        spec = url if isinstance(url, StreamSpec) else StreamSpec(url=url, split=split, **fields)
        if isinstance(url, StreamSpec) and fields:
            raise TypeError(f"ShardStream(spec) takes no further settings, got {sorted(fields)}")
        self.spec = spec
        url, split, rank, world_size, seed = spec.url, spec.split, spec.rank, spec.world_size, spec.seed
        global_batch, batch_size, endpoint_url = spec.global_batch, spec.batch_size, spec.endpoint_url
        self.dataset = open_dataset(url, split, endpoint_url=endpoint_url, carve=carve)
        self.samples_per_epoch = samples_per_rank(sum(self.dataset.counts), world_size, global_batch, rank=rank)
        self.batches_per_epoch = cycled_batches(self.samples_per_epoch, self.spec.batch_sizes, self.spec.drops_last)
        if self.batches_per_epoch == 0:  # the data, too small for the batch: a restart would meet it again
            raise DatasetError(f"split {split!r} has {sum(self.dataset.counts)} samples: {self.samples_per_epoch} "
                               f"per rank over {world_size} ranks, not one batch of {batch_size}; use a smaller "
                               "batch_size or world_size")
        self.epoch, self.position, self.seed = 0, 0, seed
        self._skipped: Counter[str] = Counter()
        self._epoch_skipped: Counter[str] = Counter()  # this rank's, since the epoch or a resume began
        self._skipped_before = 0  # all ranks' count in this epoch before the resume (from a checkpoint)
        self._skipped_total = 0  # all ranks' count in this epoch at the last check
        self._logged: set[tuple[str, str]] = set()
        self._generation = 0  # bumped by set_epoch/load_state_dict: stale iterators stop

    @property
    def _end(self) -> int:
        """Position after the epoch's last emitted sample (a partial batch dropped or not)."""
        return min(batch_bounds(self.batches_per_epoch - 1, self.spec.batch_sizes)[1], self.samples_per_epoch)

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        return cycled_batches(self._end - self.position, self.spec.batch_sizes, drop_last=False)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first sample on the next iteration."""
        non_negative(epoch, "epoch")
        self.epoch, self.position = int(epoch), 0
        self._reset_epoch_count(0)
        self._generation += 1

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed", "skipped"}``: where the next batch starts, and how many
        samples all ranks had skipped in this epoch at the last budget check."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "skipped": self._skipped_total if self.position else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`); its seed replaces the constructor's.

        ``skipped`` (optional: older checkpoints lack it) is the count of the epoch so far, all
        ranks together; the error budget goes on from there."""
        try:
            epoch, position, seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
            skipped = int(state.get("skipped", 0))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"stream state needs int 'epoch', 'position', 'seed'; got {state!r}"
            ) from exc
        if epoch < 0 or seed < 0 or skipped < 0 or not 0 <= position <= self._end:
            raise ValueError(f"stream state out of range for this dataset/world size: {state!r}")
        if position == self._end:
            epoch, position = epoch + 1, 0
        self.epoch, self.position, self.seed = epoch, position, seed
        self._reset_epoch_count(skipped if position else 0)
        self._generation += 1

    def skipped(self) -> dict[str, int]:
        """Samples skipped so far (all epochs of this stream object), per shard name."""
        return dict(self._skipped)

    def epoch_order(self) -> RankOrder:
        """This rank's order of the current epoch from the current position."""
        s = self.spec
        return rank_order(self.dataset.counts, self.seed, self.epoch, s.rank, s.world_size,
                    self.position, s.shuffle_buffer, shuffle=s.train, global_batch=s.global_batch)  # fmt: skip

    def _reset_epoch_count(self, before: int) -> None:
        self._epoch_skipped.clear()
        self._skipped_before = self._skipped_total = before

    def budget_samples(self) -> float:
        """Samples of an epoch, all ranks together, that may be skipped: ``error_budget`` x the
        epoch's samples."""
        return self.spec.error_budget * sum(self.dataset.counts)

    def epoch_skipped(self) -> int:
        """Samples this rank skipped in the current epoch since it started or was resumed (for
        the caller to sum over ranks; see :meth:`check_error_budget`)."""
        return sum(self._epoch_skipped.values())

    def check_error_budget(self, skipped_all_ranks: int,
                           gather: Callable[[Mapping[str, int]], list[Mapping[str, int]]] | None = None) -> int:
        """Raise :class:`ErrorBudgetExceeded` if the epoch's skipped samples (``skipped_all_ranks``:
        :meth:`epoch_skipped` summed over all ranks; plus the count restored from a checkpoint) exceed the
        budget; otherwise remember the total for :meth:`state_dict` and return it. ``gather`` (every rank
        calls it, at the same step) collects the ranks' per-shard counts, so the error names every rank's
        bad shards."""
        total = self._skipped_before + int(skipped_all_ranks)
        self._skipped_total = total
        if total > self.budget_samples():
            mine = dict(self._epoch_skipped)
            raise budget_error(total, self.epoch, self.spec.error_budget, sum(self.dataset.counts),
                               self.spec.world_size, gather(mine) if gather is not None else [mine])
        return total

    def _account(self, skipped: list[tuple[str, str, str]]) -> None:
        for shard, key, why in skipped:
            self._skipped[shard] += 1
            self._epoch_skipped[shard] += 1
            if (shard, key) not in self._logged:
                self._logged.add((shard, key))
                log.warning("skipped sample %s in %s: %s", key, self.dataset.storage.url_of(shard), why)
        if skipped and self.spec.world_size == 1:  # several ranks: the caller sums and checks
            self.check_error_budget(self.epoch_skipped())

    @property
    def epoch_end(self) -> int:
        """Position after the current epoch's last emitted sample."""
        return self._end

    def epoch_batches(self) -> IterableDataset:
        """The rest of the current epoch from the current position as an ``IterableDataset`` of whole
        batches (a ``DataLoader`` worker ``w`` of ``W`` builds batches ``b % W == w``), without this
        stream's bookkeeping (position, error budget): what :meth:`__iter__` runs in its DataLoader,
        and what :class:`vitscale.data.dataset.ShardDataset` wraps. A batch also holds ``_count``
        (samples it consumed) and ``_skipped`` ((shard, key, why) of each skipped sample)."""
        return _EpochBatches(self.spec, self.dataset, self.epoch_order(), self._end)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        s, gen = self.spec, self._generation
        source = self.epoch_batches()
        loader = DataLoader(
            source,
            batch_size=None,  # batches are built whole inside the workers
            num_workers=s.num_workers,
            prefetch_factor=s.prefetch_factor if s.num_workers else None,
            pin_memory=s.pin_memory,
        )
        for batch in loader:
            if gen != self._generation:
                return  # set_epoch/load_state_dict was called: this iterator is stale
            if self.position == 0:
                self._reset_epoch_count(0)  # a new epoch's first batch
            self._account(batch.pop("_skipped"))
            self.position += batch.pop("_count")
            if self.position >= self._end:  # last batch: a checkpoint now resumes next epoch
                # The epoch's count stays until the next epoch's first batch, so the caller's
                # check after this step still sees it.
                self.epoch, self.position = self.epoch + 1, 0
                self._generation += 1
            yield batch
