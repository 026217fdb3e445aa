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

One loader for every epoch. The loader's worker processes are started once and read on from one epoch
into the next (the next epoch's order is a function of the seed and its number), so the next ``for``
loop's first batches are already built when it begins: no start of ``num_workers`` processes and no
empty prefetch queue at every epoch boundary, which on a small dataset (a few steps an epoch) cost
more than the steps. Only moving the stream elsewhere (``set_epoch``, ``load_state_dict`` to another
position) or an error starts them again; ``close()`` stops them.

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
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from vitscale.config.checks import non_negative
from vitscale.data.carve import Carve
from vitscale.data.format import DatasetError, open_dataset
from vitscale.data.loader.batches import EpochBatches, epoch_order
from vitscale.data.loader.budget import ErrorBudgetExceeded, budget_error
from vitscale.data.loader.spec import StreamSpec
from vitscale.data.order import RankOrder, batch_bounds, cycled_batches, samples_per_rank
from vitscale.say import say

__all__ = ["ErrorBudgetExceeded", "ShardStream", "StreamSpec"]

log = logging.getLogger(__name__)

LOADER_RESTARTS = 3
"""Times in a row a stream starts its loader again after one of its processes died (the kernel's out-of-memory
killer, a stray `kill`) before it gives up: a batch depends only on the seed, the epoch and its samples, so the
new loader builds the ones the dead one had not handed out, the same, and no step is lost or read twice."""
_DIED = "DataLoader worker (pid"
"""How torch's errors for a loader process that is gone begin ("... exited unexpectedly", "... is killed by
signal: Killed."), as against an error a loader process raised, which comes as its own type."""


def _said(exc: Exception) -> str:
    """Torch's line for a dead loader process without its closing stop ("... is killed by signal: Killed. ")."""
    return str(exc).strip().rstrip(".")


def _death_behind(error: Exception, loader: Iterator[Any]) -> RuntimeError:
    """The death of one of `loader`'s processes behind a connection's `error`, as torch's error for it; `error`
    itself, raised again, where every process lives.

    A process killed while the batch it had queued is handed over (its tensors come through a connection to
    that process) shows as that connection's error, torch having looked for dead processes before the kernel
    let it see this one. In a main thread torch's SIGCHLD handler may say it meanwhile, raising its own error
    wherever the thread is: here, while the processes are looked at."""
    try:
        dead = _dead_processes(loader)
    except RuntimeError as signalled:
        if not str(signalled).startswith(_DIED):
            raise
        return signalled
    if not dead:
        raise error
    died = RuntimeError(f"{_DIED}(s) {', '.join(map(str, dead))}) exited unexpectedly")
    died.__cause__ = error
    return died


def _dead_processes(loader: Iterator[Any], wait: float = 1.0) -> list[int]:
    """The ids of `loader`'s processes that have exited, waiting up to `wait` seconds for one to."""
    processes = list(getattr(loader, "_workers", []))
    deadline = time.monotonic() + wait
    while True:
        dead = [p.pid for p in processes if not p.is_alive()]
        if dead or not processes or time.monotonic() > deadline:
            return dead
        time.sleep(0.02)


def _gave_up(deaths: int, workers: int) -> str:
    return (f"the loader's processes died {deaths} times in a row, each before its next batch: where the "
            f"kernel killed them for memory (dmesg: 'Out of memory'), fewer leave each more "
            f"(data.num_workers: {workers})")


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
        self._generation = 0  # bumped as an epoch ends and by a move (set_epoch/load_state_dict): stale iterators stop
        self._loader: tuple[int, Iterator[dict[str, Any]]] | None = None
        """(the generation it reads for, the one DataLoader iterator over every epoch from there): kept from one
        epoch to the next, dropped when the stream is moved."""
        self._reading: object | None = None  # the iterator reading from the loader now: an older one stops

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
        self._move(int(epoch), 0, self.seed)
        self._reset_epoch_count(0)

    def _move(self, epoch: int, position: int, seed: int) -> None:
        """Put the stream at (``epoch``, ``position``) of ``seed``'s order: where it is already, the loader goes on
        (the batches it reads next are those); elsewhere, iterators of the old place stop and the next one
        starts a loader there."""
        if (epoch, position, seed) != (self.epoch, self.position, self.seed):
            self.epoch, self.position, self.seed = epoch, position, seed
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
        self._move(epoch, position, seed)
        self._reset_epoch_count(skipped if position else 0)

    def skipped(self) -> dict[str, int]:
        """Samples skipped so far (all epochs of this stream object), per shard name."""
        return dict(self._skipped)

    def epoch_order(self) -> RankOrder:
        """This rank's order of the current epoch from the current position."""
        return epoch_order(self.spec, self.dataset.counts, self.seed, self.epoch, self.position)

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
        stream's bookkeeping (position, error budget): what :class:`vitscale.data.dataset.ShardDataset`
        wraps (:meth:`__iter__` reads the same batches and the later epochs' after them). A batch also holds
        ``_count`` (samples it consumed) and ``_skipped`` ((shard, key, why) of each skipped sample)."""
        return EpochBatches(self.spec, self.dataset, self.epoch_order(), self._end)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        gen, me = self._generation, object()
        if self._loader is None or self._loader[0] != gen:  # none yet, or one reading for a place left since
            self.close()
            self._loader = (gen, self._open())
        self._reading = me
        while gen == self._generation and self._reading is me:  # else moved, or a newer iterator reads
            try:
                batch = self._next(gen)  # never ends: the loader reads on into the next epoch
                if self.position == 0:
                    self._reset_epoch_count(0)  # a new epoch's first batch
                self._account(batch.pop("_skipped"))
                self.position += batch.pop("_count")
            except BaseException:  # a dead loader, a budget exceeded, Ctrl-C: the loader's place is lost
                self.close()
                raise
            if self.position >= self._end:  # last batch: a checkpoint now resumes next epoch
                # The epoch's count stays until the next epoch's first batch, so the caller's
                # check after this step still sees it.
                self.epoch, self.position = self.epoch + 1, 0
                self._generation += 1
                self._loader = (self._generation, self._loader[1])  # the next epoch's iterator reads on from it
            yield batch

    def _next(self, gen: int) -> dict[str, Any]:
        """The loader's next batch; a loader whose process died is started again where the stream is (the
        batches it had built but not handed out are built again, the same), up to `LOADER_RESTARTS` times in
        a row without a batch between."""
        restarts = 0
        while True:
            assert self._loader is not None  # opened by `__iter__`, and again below
            try:
                return next(self._loader[1])
            except RuntimeError as error:
                if not str(error).startswith(_DIED):
                    raise
                exc = error
            except (ConnectionError, EOFError) as error:
                exc = _death_behind(error, self._loader[1])
            if restarts == LOADER_RESTARTS:
                raise RuntimeError(f"{_said(exc)}; {_gave_up(restarts + 1, self.spec.num_workers)}") from exc
            # On the terminal, not only in the log: a death is rare, and the same one again ends the attempt.
            say(f"rank {self.spec.rank}: {_said(exc)}: its loader started again at epoch {self.epoch}, "
                f"sample {self.position} of this rank's")
            restarts += 1
            self.close()
            self._loader = (gen, self._open())

    def _open(self) -> Iterator[dict[str, Any]]:
        """A DataLoader iterator over this rank's batches from here on, epoch after epoch."""
        s = self.spec
        return iter(DataLoader(
            EpochBatches(s, self.dataset, self.epoch_order(), self._end, epochs=None),
            batch_size=None,  # batches are built whole inside the workers
            num_workers=s.num_workers,
            prefetch_factor=s.prefetch_factor if s.num_workers else None,
            pin_memory=s.pin_memory,
        ))

    def close(self) -> None:
        """Stop the loader's worker processes now (the next iteration starts new ones where the stream is)."""
        loader, self._loader = self._loader, None
        # Joined here rather than when the last reference goes (an iterator of an earlier epoch may hold it):
        # their time is then counted (`vitscale shards bench`) and no process outlives the stream's use.
        shutdown = getattr(loader[1], "_shutdown_workers", None) if loader is not None else None
        if shutdown is not None:
            shutdown()
