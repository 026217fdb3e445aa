"""Sample order: which rank sees which sample, in which order, as a pure function of the shard
sizes and (seed, epoch, rank, world_size). Pure numpy; it opens nothing (except :func:`rank_keys`,
which reads a dataset through :mod:`vitscale.data.format` for the CLI).

Samples get a *global index* over the dataset: shard ``i`` (in ``dataset.json`` order) holds
indices ``[base[i], base[i] + counts[i])`` in the order they sit in the tar. One epoch is ordered
so:

1. **Shard order.** A permutation of the shards drawn from (seed, epoch); the epoch's sample
   *sequence* is the shards' samples concatenated in that order (positions ``0 .. N-1``).
2. **Rank layout**, one of two:

   - *Global batches* (``global_batch=G``, training). The first ``S*G`` positions (``S = N // G``
     optimizer steps) are the epoch; the last ``N - S*G < G`` are left out (which samples those
     are changes every epoch with the shard order). Step ``k`` consumes positions
     ``[k*G, (k+1)*G)`` and rank ``r`` of ``W`` takes its *share*, the ``n_r = hi_r - lo_r``
     positions ``[k*G + lo_r, k*G + hi_r)`` with ``lo_r = r*G // W``, ``hi_r = (r+1)*G // W``
     (:func:`share_bounds`): ``G / W`` each when ``W`` divides ``G``, else ``floor`` or ``ceil`` of
     it. The sequence of samples the *steps* consume is therefore the same whatever the world size:
     a run that goes from ``W`` to ``W'`` ranks after step ``k`` opens rank ``r`` of the new world
     at ``start = k * n_r`` and every sample of the epoch is still consumed exactly once (elastic
     training, ``cluster.num_workers: [MIN, MAX]``, any ``W <= G``).
   - *Rank spans* (``global_batch=None``: evaluation, and users' own loops). ``m = N // world_size``
     samples per rank; rank ``r`` takes sequence positions ``[r*m, (r+1)*m)``: a contiguous run of
     shards, so it touches at most two partial shards. The last ``N - world_size*m < world_size``
     positions are left out.
3. **Window shuffle.** The positions in play (the epoch's ``S*G``, or the rank's span) are cut into
   windows of ``shuffle_buffer`` consecutive positions and each window is permuted by a permutation
   drawn from (seed, epoch, window start). Memory for the shuffle is one window of indices,
   whatever the dataset size, and a reader jumps around within one window (a few shards) at a time;
   with global batches all ranks read the same window at once, each its own samples (ranged reads).

Guarantees (property-tested in ``tests/test_order.py``, ``tests/test_order_elastic.py``): per
epoch the ranks' orders are disjoint, equally long (rank spans; global batches: each step's shares
differ by at most one sample) and together miss fewer than ``world_size`` samples (rank spans) or
``global_batch`` (global batches); the order depends only on (counts, seed, epoch, rank, world_size, shuffle_buffer,
global_batch) and changes with the epoch; ordering from ``start=k`` yields exactly the tail ``[k:]``
of the order from 0; with global batches, the samples consumed by steps ``1..k`` at any world size
followed by steps ``k+1..`` at any other are the epoch's samples, each exactly once.

Batches within a rank are consecutive runs of ``batch_size`` positions (global batches: each
share cut into the same number of batches on every rank, :func:`micro_batch_sizes`, cycling from
the stream's start: :func:`batch_bounds`); with several data-loader
workers, batch ``b`` is built whole by worker ``b % num_workers`` (:func:`worker_batches`), which
is the order PyTorch's ``DataLoader`` collects them in, so the emitted order is this order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEFAULT_SHUFFLE_BUFFER",
    "RankOrder",
    "ShardRange",
    "batch_bounds",
    "cycled_batches",
    "micro_batch_sizes",
    "num_batches",
    "rank_keys",
    "rank_order",
    "samples_per_rank",
    "share_bounds",
    "split_evenly",
    "worker_batches",
]

DEFAULT_SHUFFLE_BUFFER = 10_000
"""Window of the in-span sample shuffle (a few shards of ImageNet-sized samples): the one default,
`data.shuffle_buffer`'s too, so a pipeline that leaves it out reads what the API does."""

# Distinct first words of the SeedSequence entropy keep the shard-order and window streams apart.
_SHARD_STREAM = 0
_WINDOW_STREAM = 1


@dataclass(frozen=True)
class ShardRange:
    """Samples ``[lo, hi)`` (positions inside the tar, 0-based) of shard number ``shard``."""

    shard: int
    lo: int
    hi: int


@dataclass(frozen=True, eq=False)
class RankOrder:
    """One rank's order for one epoch, from position ``start`` on (computed lazily per window)."""

    seed: int
    epoch: int
    rank: int
    world_size: int
    start: int
    shuffle_buffer: int
    shuffle: bool
    samples_per_rank: int
    """Samples this rank sees this epoch (:func:`samples_per_rank`; with global batches the ranks'
    counts differ when ``world_size`` does not divide ``global_batch``)."""
    global_batch: int | None
    """Samples per optimizer step over all ranks (global-batch layout), or None (rank spans)."""
    extent: int
    """Sequence positions the windows cover: the epoch's ``S*G`` (global batches) or ``m`` (a span)."""
    shard_order: np.ndarray
    """(num_shards,) int64: shard numbers in this epoch's sequence order."""
    bases: np.ndarray
    """(num_shards + 1,) int64: global index of each shard's first sample (dataset order)."""
    seq_offsets: np.ndarray
    """(num_shards + 1,) int64: sequence position of each shard in ``shard_order``'s order."""

    def __len__(self) -> int:
        return self.samples_per_rank - self.start

    @property
    def span_start(self) -> int:
        """Sequence position where this rank's windows start: its span's first position (rank
        spans), or 0 (global batches: the windows are the whole epoch's, shared by all ranks)."""
        return 0 if self.global_batch is not None else self.rank * self.samples_per_rank

    @property
    def window(self) -> int:
        """Positions per shuffle window: ``shuffle_buffer``, or the whole extent where the buffer holds more. Both
        make one window and the same order; this one stays in the int64 NumPy computes positions in (a
        `data.shuffle_buffer` of 10**20 was an OverflowError in every worker)."""
        return min(self.shuffle_buffer, max(1, self.extent))

    def _window_perm(self, window: int) -> np.ndarray:
        """Permutation of window ``window`` (relative positions), from (seed, epoch, its start)."""
        lo = window * self.window
        n = min(self.window, self.extent - lo)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        ss = np.random.SeedSequence([_WINDOW_STREAM, self.seed, self.epoch, self.span_start + lo])
        return np.random.default_rng(ss).permutation(n).astype(np.int64)

    def _layout(self, positions: np.ndarray) -> np.ndarray:
        """Window-relative sequence positions (before the window shuffle) of this rank's ``positions``."""
        if self.global_batch is None:
            return positions
        lo, hi = share_bounds(self.global_batch, self.world_size, self.rank)
        share = hi - lo  # this rank's n_r of every global batch
        return (positions // share) * self.global_batch + lo + positions % share

    def sequence_to_global(self, seq: np.ndarray) -> np.ndarray:
        """Global sample indices of epoch-sequence positions ``seq`` (any int array)."""
        k = np.searchsorted(self.seq_offsets, seq, side="right") - 1
        return self.bases[self.shard_order[k]] + (seq - self.seq_offsets[k])

    def global_indices(self, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """(hi - lo,) int64 global indices at this rank's positions ``[lo, hi)`` of the epoch.

        Defaults: ``lo = start``, ``hi = samples_per_rank``. Only the windows touched are built.
        """
        lo = self.start if lo is None else lo
        hi = self.samples_per_rank if hi is None else hi
        if not 0 <= lo <= hi <= self.samples_per_rank:
            raise ValueError(f"positions [{lo}, {hi}) outside [0, {self.samples_per_rank}]")
        b = self.window
        rel = self._layout(np.arange(lo, hi, dtype=np.int64))  # increasing: windows come in order
        windows = rel // b
        seq = np.empty_like(rel)
        cuts = np.flatnonzero(np.diff(windows)) + 1
        for part in np.split(np.arange(rel.size), cuts) if rel.size else []:
            w = int(windows[part[0]])
            seq[part] = w * b + self._window_perm(w)[rel[part] - w * b]
        return self.sequence_to_global(self.span_start + seq)

    @property
    def indices(self) -> np.ndarray:
        """All global indices from ``start`` to the end of the epoch, in order (materialised)."""
        return self.global_indices()

    @property
    def ranges(self) -> tuple[ShardRange, ...]:
        """Shard ranges this rank reads from ``start`` on, in sequence order.

        They cover the windows from the one holding ``start`` to the end of the span (or of the
        epoch, with global batches): a superset of the remaining samples (the current window's
        consumed ones included). A rank span touches at most two partial shards; with global
        batches every rank reads from every shard, one window at a time.
        """
        b = self.window
        left = self.start < self.samples_per_rank
        first = int(self._layout(np.array([self.start]))[0]) if left else 0
        lo = self.span_start + (first // b) * b if left else 0
        hi = self.span_start + self.extent if left else 0
        out = []
        k = int(np.searchsorted(self.seq_offsets, lo, side="right")) - 1
        while lo < hi:
            shard_end = int(self.seq_offsets[k + 1])
            if shard_end > lo:
                first = lo - int(self.seq_offsets[k])
                take = min(hi, shard_end) - lo
                out.append(ShardRange(int(self.shard_order[k]), first, first + take))
                lo += take
            k += 1
        return tuple(out)

    def locate(self, global_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, position inside the shard) of global indices (dataset order)."""
        shard = np.searchsorted(self.bases, global_index, side="right") - 1
        return shard, global_index - self.bases[shard]


def rank_order(
    counts: Sequence[int],
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    start: int = 0,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
    *,
    shuffle: bool = True,
    global_batch: int | None = None,
) -> RankOrder:
    """Rank ``rank``'s samples for ``epoch`` in order, from its position ``start`` on.

    ``counts`` are the samples per shard in ``dataset.json`` order. With ``shuffle=False``
    (evaluation) shards keep that order and samples tar order; the rank split is the same.
    ``global_batch`` (at least ``world_size``) lays the epoch out in global batches, each rank
    taking its share of every one (:func:`share_bounds`), so the samples each optimizer step
    consumes do not depend on the world size; None gives each rank one contiguous span. See the module docstring for the
    algorithm and its guarantees.
    """
    c = np.asarray(list(counts), dtype=np.int64)
    if c.ndim != 1 or (c < 0).any():
        raise ValueError("counts must be a sequence of non-negative sample counts, one per shard")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    if shuffle_buffer < 1:
        raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
    m = samples_per_rank(int(c.sum()), world_size, global_batch, rank=rank)
    if not 0 <= start <= m:
        raise ValueError(f"start must be in [0, {m}] (samples per rank this epoch), got {start}")
    bases = np.zeros(c.size + 1, dtype=np.int64)
    np.cumsum(c, out=bases[1:])
    if shuffle and c.size > 1:
        ss = np.random.SeedSequence([_SHARD_STREAM, seed, epoch])
        order = np.random.default_rng(ss).permutation(c.size).astype(np.int64)
    else:
        order = np.arange(c.size, dtype=np.int64)
    seq_offsets = np.zeros(c.size + 1, dtype=np.int64)
    np.cumsum(c[order], out=seq_offsets[1:])
    return RankOrder(
        seed=seed,
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        start=start,
        shuffle_buffer=shuffle_buffer,
        shuffle=shuffle,
        samples_per_rank=m,
        global_batch=global_batch,
        extent=m if global_batch is None else int(c.sum()) // global_batch * global_batch,
        shard_order=order,
        bases=bases,
        seq_offsets=seq_offsets,
    )


def samples_per_rank(samples: int, world_size: int, global_batch: int | None = None, *, rank: int = 0) -> int:
    """Samples rank ``rank`` of ``world_size`` takes from an epoch of ``samples``: ``samples // world_size``
    (rank spans), or its share ``n_r`` (:func:`share_bounds`) of each of the epoch's
    ``samples // global_batch`` whole global batches."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if global_batch is None:
        return samples // world_size
    lo, hi = share_bounds(global_batch, world_size, rank)
    return (samples // global_batch) * (hi - lo)


def share_bounds(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """Positions ``[r*G // W, (r+1)*G // W)`` of each global batch of ``G`` that rank ``r`` of ``W`` takes.

    Contiguous and in rank order, so the shares tile the batch; their sizes are ``floor(G/W)`` or
    ``ceil(G/W)`` (differ by at most one), and exactly ``G / W`` each when ``W`` divides ``G``.
    """
    if global_batch < world_size or world_size < 1:
        raise ValueError(f"global_batch must be >= world_size={world_size} (every rank takes at least one "
                         f"sample of each global batch), got {global_batch}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank * global_batch // world_size, (rank + 1) * global_batch // world_size


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """``total`` cut into ``parts`` sizes as even as possible (they differ by at most one), larger first."""
    if parts < 1 or total < 0:
        raise ValueError(f"cannot split {total} into {parts} parts")
    q, extra = divmod(total, parts)
    return (q + 1,) * extra + (q,) * (parts - extra)


def micro_batch_sizes(global_batch: int | None, world_size: int, rank: int, batch_size: int) -> tuple[int, ...]:
    """The batches rank ``rank`` cuts its share of each global batch into (one optimizer step's micro-batches);
    ``(batch_size,)`` without global batches (rank spans).

    Every rank cuts its share into the same number ``g = ceil(ceil(G/W) / batch_size)`` (gradient
    accumulation boundaries are global), as evenly as possible (:func:`split_evenly`): with ``W``
    dividing ``G`` and ``batch_size`` dividing ``G/W`` that is ``G / (W * batch_size)`` batches of
    ``batch_size``. A size 0 (a share smaller than ``g``) is possible and is the caller's to refuse.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if global_batch is None:
        return (batch_size,)
    lo, hi = share_bounds(global_batch, world_size, rank)
    largest = -(-global_batch // world_size)
    return split_evenly(hi - lo, -(-largest // batch_size))


def num_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches from ``samples`` positions: full ones only when ``drop_last``, else one partial."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return samples // batch_size if drop_last else -(-samples // batch_size)


def cycled_batches(samples: int, sizes: Sequence[int], drop_last: bool) -> int:
    """Batches from ``samples`` positions cut into batches of ``sizes[0], sizes[1], ...`` over and
    over (:func:`batch_bounds`): full ones only when ``drop_last``, else one partial. ``sizes ==
    (b,)`` is :func:`num_batches`."""
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {tuple(sizes)}")
    periods, left = divmod(samples, sum(sizes))
    full = 0
    while full < len(sizes) and left >= sizes[full]:
        left -= sizes[full]
        full += 1
    return periods * len(sizes) + full + (1 if left and not drop_last else 0)


def batch_bounds(batch: int, sizes: Sequence[int]) -> tuple[int, int]:
    """Positions ``[lo, hi)`` (relative to the first batch's start) of batch number ``batch`` when
    positions are cut into batches of ``sizes[0], sizes[1], ...`` over and over."""
    g = len(sizes)
    q, i = divmod(batch, g)
    lo = q * sum(sizes) + sum(sizes[:i])
    return lo, lo + sizes[i]


def worker_batches(batches: int, worker: int, num_workers: int) -> range:
    """Batch numbers worker ``worker`` builds: ``b % num_workers == worker`` (DataLoader order)."""
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ValueError(f"worker must be in [0, num_workers), got {worker} of {num_workers}")
    return range(worker, batches, num_workers)


def rank_keys(
    dataset_url: str,
    split: str,
    *,
    rank: int,
    world_size: int,
    epoch: int,
    seed: int = 0,
    start: int = 0,
    endpoint_url: str | None = None,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
    global_batch: int | None = None,
) -> list[str]:
    """Sample keys rank ``rank`` sees in ``epoch``, from position ``start``, in training order.

    The same order :class:`vitscale.data.loader.stream.ShardStream` emits (training mode), read from the
    dataset's ``dataset.json`` and ``_index.parquet``; backs ``vitscale shards order``.
    """
    # Imported here so importing this module stays a pure algorithm: no storage or parquet.
    from vitscale.config.checks import check
    from vitscale.data.format import open_dataset

    ds = open_dataset(dataset_url, split, endpoint_url=endpoint_url)
    total = sum(ds.counts)
    # no batch fills (training refuses it; 10**20 overflowed)
    check(global_batch is None or global_batch <= total, "global_batch",
          f"must be at most the {total} samples of {split!r} (an epoch holds at least one batch), got {global_batch}")
    m = samples_per_rank(total, world_size, global_batch, rank=rank) if 0 <= rank < world_size else 0
    check(0 <= start <= m, "start",  # the arguments only the dataset bounds: the user's to fix, said so
          f"must be in [0, {m}] (rank {rank}'s samples of {split!r} in an epoch over {world_size} ranks), got {start}")
    p = rank_order(ds.counts, seed, epoch, rank, world_size, start, shuffle_buffer, global_batch=global_batch)
    shard, local = p.locate(p.indices)
    index = ds.load_index(np.unique(shard).tolist())  # the shards its samples are in, no more
    return [index[int(s)].key(int(i)) for s, i in zip(shard, local)]
