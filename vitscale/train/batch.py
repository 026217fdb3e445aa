"""The batch rule: how one optimiser step's global batch is split over workers and micro-batches.

Pure arithmetic (no torch): the config checks it before Ray starts (`train/config.py`), the worker
splits its steps by it (`train/worker.py`, `train/step.py`), and an elastic run's sizes are checked
against it (`elastic_split`). The paper's batch is 4096 (Table 3) on any number of devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from vitscale.config.checks import positive_int
from vitscale.data.order import micro_batch_sizes, share_bounds

__all__ = ["BatchPlan", "derive_batch", "elastic_split", "loss_weight", "nearest_valid_global_batch", "resized_batch"]


@dataclass(frozen=True)
class BatchPlan:
    """How one optimiser step's global batch is split: global = micro x accum x world when the world
    size divides it (even shares); otherwise each rank's share (floor or ceil of global / world) is cut
    into ``grad_accum_steps`` micro-batches of at most ``micro_batch`` (:meth:`micro_sizes`)."""

    micro_batch: int
    """Examples per forward/backward pass on one worker: the largest micro-batch of any rank."""
    grad_accum_steps: int
    """Micro-batches accumulated per worker before each optimiser step: the same on every rank."""
    world_size: int
    """Number of data-parallel workers."""
    global_batch: int
    """Examples per optimiser step over all workers (``train.global_batch``; the paper: 4096)."""

    @property
    def even(self) -> bool:
        """Every micro-batch of every rank holds ``micro_batch`` examples (loss weights all 1)."""
        return self.micro_batch * self.grad_accum_steps * self.world_size == self.global_batch

    def share(self, rank: int) -> int:
        """Examples rank ``rank`` takes of each global batch (``data/order.py``'s ``share_bounds``)."""
        lo, hi = share_bounds(self.global_batch, self.world_size, rank)
        return hi - lo

    def micro_sizes(self, rank: int) -> tuple[int, ...]:
        """Rank ``rank``'s ``grad_accum_steps`` micro-batch sizes in one step (the stream cuts the same)."""
        return micro_batch_sizes(self.global_batch, self.world_size, rank, self.micro_batch)


def loss_weight(examples: int, plan: BatchPlan) -> float:
    """Factor on the mean loss of a micro-batch of ``examples`` so the step's gradient is the global batch's mean.

    DeepSpeed divides each micro-batch's loss by ``grad_accum_steps`` and averages gradients over
    ``world_size`` ranks, which is the global mean only when every micro-batch is equally large. A
    micro-batch of ``n`` examples whose mean loss is ``L`` therefore backpropagates
    ``L * n * world_size * grad_accum_steps / global_batch``: summed over all micro-batches and
    ranks, divided by ``grad_accum_steps * world_size``, that is ``(1 / global_batch) * sum of the
    per-example losses``. Exactly 1.0 for the micro-batches of an even plan.
    """
    return examples * plan.world_size * plan.grad_accum_steps / plan.global_batch


def nearest_valid_global_batch(global_batch: int, micro_batch: int, world_size: int) -> int:
    """The multiple of ``micro_batch * world_size`` closest to ``global_batch`` (ties go up; >= one unit)."""
    positive_int(global_batch, "train.global_batch")
    positive_int(micro_batch, "train.micro_batch")
    positive_int(world_size, "world_size")
    unit = micro_batch * world_size
    below = (global_batch // unit) * unit
    above = below + unit
    if below == 0 or above - global_batch <= global_batch - below:
        return above
    return below


def derive_batch(global_batch: int, micro_batch: int, world_size: int, *, section: str = "train",
                 world: str = "world_size") -> BatchPlan:
    """Gradient-accumulation plan such that ``global_batch == micro * grad_accum_steps * world_size``, where
    ``micro`` is ``micro_batch``, or each worker's whole share where that share is smaller.

    Raises:
        ValueError: an argument is not a positive integer, or ``global_batch`` is not a multiple of
            ``micro_batch * world_size``; the message names ``train.global_batch`` and
            ``train.micro_batch`` (``section`` names another, e.g. ``finetune.train``; ``world`` says
            where the world size comes from) and gives the nearest global batch and the largest micro batch
            (at most the requested one) that would work.
    """
    positive_int(global_batch, f"{section}.global_batch")
    positive_int(micro_batch, f"{section}.micro_batch")
    positive_int(world_size, world)
    unit = micro_batch * world_size
    if global_batch % unit == 0:
        return BatchPlan(micro_batch, global_batch // unit, world_size, global_batch)
    share, left = divmod(global_batch, world_size)
    if not left and share < micro_batch:
        # `micro_batch` is a ceiling (the memory one pass may take): a share below it is one pass, as
        # `resized_batch` makes it. A laptop's `global_batch: 8` needs no `micro_batch` of its own.
        return BatchPlan(share, 1, world_size, global_batch)

    # Below one full micro-batch per worker any whole share is one pass: then a multiple of the workers fits.
    step = unit if global_batch >= unit else world_size
    lower = max(step, global_batch // step * step)
    hints = [
        f"set {section}.global_batch to {nearest_valid_global_batch(global_batch, step // world_size, world_size)}"
        f" (a multiple of {step}: try {lower} or {lower + step})"
    ]
    if global_batch % world_size == 0:
        per_worker = global_batch // world_size
        # Largest divisor of the per-worker batch not above the requested micro batch: the biggest
        # micro batch that still fits in the memory the user budgeted for.
        best = max(m for m in range(1, min(micro_batch, per_worker) + 1) if per_worker % m == 0)
        hints.append(f"or set {section}.micro_batch to {best} (divides {per_worker} examples per worker)")
    rule = (f"is not divisible by {section}.micro_batch={micro_batch} x {world}={world_size} = {unit}" if step == unit
            else f"does not split evenly over {world}={world_size} workers")
    raise ValueError(f"{section}.global_batch={global_batch} {rule}; " + ", ".join(hints))


def resized_batch(global_batch: int, micro_batch: int, world_size: int) -> BatchPlan:
    """The plan at a world size an elastic run reached: the same ``global_batch`` at any world size.

    ``world_size`` divides ``global_batch``: each worker's ``global_batch / world_size`` share in the
    largest micro batch not above ``micro_batch`` that divides it, times the accumulation steps (where
    ``derive_batch`` succeeds it gives the same plan). Otherwise the shares are ``floor`` or ``ceil`` of
    ``global_batch / world_size`` (``data/order.py``) and every rank accumulates the same
    ``ceil(ceil(global_batch / world_size) / micro_batch)`` micro-batches (DeepSpeed's accumulation
    boundary is global), its share cut into them as evenly as possible; ``micro_batch`` in the plan is
    then the largest of them. The loop weights each micro-batch's loss (:func:`loss_weight`).

    Raises:
        ValueError: a share cannot fill the accumulation steps (a micro-batch would be empty: more
            workers than examples, or ``micro_batch`` 1 with uneven shares).
    """
    positive_int(global_batch, "train.global_batch")
    positive_int(micro_batch, "train.micro_batch")
    positive_int(world_size, "world_size")
    share, left = divmod(global_batch, world_size)
    if not left:
        micro = max(m for m in range(1, min(micro_batch, share) + 1) if share % m == 0)
        return BatchPlan(micro, share // micro, world_size, global_batch)
    accum = -(-(share + 1) // micro_batch)
    if share < accum:
        raise ValueError(f"train.global_batch={global_batch} over {world_size} workers gives shares of {share} and "
                         f"{share + 1} examples, cut into {accum} micro-batches of at most train.micro_batch="
                         f"{micro_batch}: a share of {share} would leave a micro-batch empty; "
                         + ("use a train.micro_batch of 2 or more" if share else "use fewer workers"))
    return BatchPlan(-(-(share + 1) // accum), accum, world_size, global_batch)


def elastic_split(global_batch: int, micro_batch: int, world_sizes: range, *, section: str = "train",
                  world: str = "cluster.num_workers") -> None:
    """Every world size an elastic run may reach has a batch plan (``resized_batch``): the global batch
    need not divide evenly (uneven shares are weighted), but every worker needs at least one example
    in each of its micro-batches; else a ValueError, one line naming the sizes that cannot."""
    positive_int(global_batch, f"{section}.global_batch")
    positive_int(micro_batch, f"{section}.micro_batch")
    uneven, empty = unshareable(global_batch, micro_batch, world_sizes)
    if not uneven and empty is None:
        return
    named = [str(w) for w in uneven[:_LISTED]] + (["..."] if len(uneven) > _LISTED else [])
    named += [f"{empty[0]}-{empty[1]}" if empty[1] > empty[0] else str(empty[0])] if empty else []
    advice = ([f"a share in micro-batches of {section}.micro_batch={micro_batch} leaves one empty unless the "
               f"size divides {global_batch}; use {section}.micro_batch >= 2"] if uneven else [])
    advice += [f"more workers than examples; use a global batch of at least {world_sizes[-1]}"] if empty else []
    raise ValueError(f"{section}.global_batch={global_batch} cannot be shared over {', '.join(named)} workers, "
                     f"which {world}: [{world_sizes[0]}, {world_sizes[-1]}] may run at: {'; '.join(advice)}")


_LISTED = 12
"""Sizes named one by one in elastic_split's line; a range may reach millions."""


def unshareable(global_batch: int, micro_batch: int, world_sizes: range) -> tuple[list[int], tuple[int, int] | None]:
    """The world sizes of `world_sizes` at which ``resized_batch`` has no plan, found without trying each (a
    range may be [1, 10**12]): (sizes at or below the global batch, in order, at most `_LISTED` + 1 of them;
    the span (first, last) above it, or None).

    Above the global batch a worker gets no example. At or below it, an even split always has a plan, and an
    uneven one's share of ``s`` examples fills its ``ceil((s + 1) / micro_batch)`` micro-batches whenever
    ``micro_batch >= 2`` (that count is at most ``s``); with ``micro_batch`` 1 it cannot (``s + 1 > s``). So
    the sizes at or below it that have no plan are, with ``micro_batch`` 1, those that do not divide it.
    """
    lo, hi = world_sizes[0], world_sizes[-1]
    empty = (max(lo, global_batch + 1), hi) if hi > global_batch else None
    uneven: list[int] = []
    if micro_batch == 1:
        # A run of consecutive divisors of an integer is short (their lcm divides it), so this stops soon.
        for w in range(lo, min(hi, global_batch) + 1):
            if global_batch % w:
                uneven.append(w)
                if len(uneven) > _LISTED:
                    break
    return uneven, empty
