"""What decides a training loader's batches: the dataset, the rank's share, the order's seed, the transform."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from vitscale.config.checks import check, fraction, non_negative, positive_int
from vitscale.data.config import DEFAULT_ERROR_BUDGET, MAX_LOADER_WORKERS
from vitscale.data.corruption import Corruption
from vitscale.data.loader.transforms import TransformSpec
from vitscale.data.order import DEFAULT_SHUFFLE_BUFFER, micro_batch_sizes

__all__ = ["StreamSpec"]


@dataclass(frozen=True)
class StreamSpec:
    """Everything that decides a stream's content (see :class:`vitscale.data.loader.stream.ShardStream`)."""

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
