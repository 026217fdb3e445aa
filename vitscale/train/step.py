"""One optimizer step of the worker loop: micro-batches in, the ranks' verdict out.

`Stepper.step` is the whole GPU-facing part of a training step, exactly as a Ray Train worker runs it
(`train/loop.py`) and as `benchmarks/mfu.py` times it: the uint8 batch moved to the device and
normalised there, forward and the objective's loss (`train/objective.py`: rows a corrupt sample refilled
left out, uneven shares weighted), backward into DeepSpeed's accumulation, then one all-reduce that
carries the loss, the objective's counts and the loop's per-step votes together, and the guarded
optimizer step (`train/update.py`).

Host syncs are what keep a GPU idle between kernels, so a step has as few as the engine allows: at ZeRO
1/2 on a GPU one, reading the all-reduced loss and votes, the update's verdict and the gradient norm
together once the step's kernels are queued; elsewhere two more (the loss before the update, the
verdict's all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vitscale.data.loader.transforms import normalize_on_device
from vitscale.train.batch import BatchPlan, loss_weight
from vitscale.train.engine import set_lr
from vitscale.train.feed import Feed
from vitscale.train.objective import Objective, Supervised
from vitscale.train.update import apply_update


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step tells the loop."""

    loss: float
    """Mean loss over all ranks (the global batch's mean when shares are uneven); NaN on any rank -> NaN."""
    applied: bool
    """Whether the update changed the weights (not when a loss or gradient was non-finite anywhere)."""
    grad_norm: float
    """Global gradient norm before clipping (NaN when the engine reports none)."""
    votes: tuple[float, ...]
    """The loop's per-step votes, summed over ranks (see `Stepper.step`)."""
    keys: list[str]
    """Keys of the samples this rank consumed, in order."""
    data_wait_s: float
    """Seconds spent waiting for the loader."""
    patch_accuracy: float | None = None
    """Masked patch prediction: the share of the step's corrupted patches (all ranks) whose target the model
    predicted; None for the supervised objective."""


class Stepper:
    """Runs optimizer steps of one engine over micro-batches from the shard stream.

    Args:
        engine: the DeepSpeed engine (`engine.build_engine`).
        train: the typed train config (precision).
        batch: the batch plan at this world size (micro-batches per step, uneven-share weights).
        device: where the model lives.
        world_size: ranks in the step's all-reduce.
        objective: what the loss is (`train/objective.py`); None: supervised by `train`.
    """

    def __init__(self, engine: Any, train: Any, batch: BatchPlan, device: torch.device, world_size: int,
                 objective: Objective | None = None) -> None:
        self.engine, self.train, self.batch, self.device = engine, train, batch, device
        self.world_size = world_size
        self.objective = objective if objective is not None else Supervised(train)
        self.dtype = torch.bfloat16 if train.precision == "bf16" else torch.float32
        self.feed = Feed(device)

    def step(self, batches: Iterator[dict[str, Any]], lr: float,
             votes: Callable[[], list[float]] = list, ahead: bool = False) -> StepOutcome:
        """One optimizer step over the next `batch.grad_accum_steps` micro-batches of `batches`.

        `votes` is called once the step's micro-batches are read (so a count kept by the stream includes
        them) and returns small host numbers that every rank must agree on this step (rank 0's "ask Ray
        about preemption", "this rank was told to stop", the epoch's skipped samples): they ride in the
        loss's all-reduce, summed over ranks, instead of costing a collective and a host sync each.
        `ahead`: the next step reads on from `batches` (the epoch goes on), so its first micro-batch is read
        and sent to the device while this step's update runs (`train/feed.py`); each micro-batch after the
        first of a step is, always, while the one before it runs.
        """
        set_lr(self.engine, lr)
        step_loss = torch.zeros((), device=self.device)
        tally = torch.zeros(2, device=self.device)  # masked patches: (hits, predicted patches) of the step
        keys: list[str] = []
        data_wait = 0.0
        for micro_step in range(self.batch.grad_accum_steps):
            micro, pixels, waited = self.feed.take(batches)
            data_wait += waited
            loss, counts = self.objective.loss(self.engine, pixels, normalize_on_device(pixels, self.dtype), micro)
            if not self.batch.even:  # n examples of the global batch's G: L * n * W * accum / G
                loss = loss * loss_weight(len(micro["key"]), self.batch)
            self.engine.backward(loss)
            step_loss += loss.detach() / self.batch.grad_accum_steps
            if counts is not None:
                tally += counts
            keys.extend(micro["key"])
            if micro_step < self.batch.grad_accum_steps - 1:
                self.engine.step()  # inside the accumulation: DeepSpeed only counts the micro-step
                data_wait += self.feed.ahead(batches)  # the step's next micro-batch, while this one runs
        # Mean loss over all ranks (weighted: the global batch's mean at any world size): what the user
        # compares across runs. A NaN on any rank makes the sum NaN on every rank, so all skip the same steps.
        reduced = torch.cat([step_loss.reshape(1).float(), tally, self._on_device(votes())])
        torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.SUM)
        # The update reads the loss sum on the device where it can (`train/update.py`): then the step's one
        # host sync is this read, after every kernel of the step is queued (and the next step's first images).
        update = apply_update(self.engine, loss=reduced[0])
        if ahead:
            data_wait += self.feed.ahead(batches)
        applied, grad_norm, (total, hits, predicted, *summed) = update.read(reduced)
        return StepOutcome(loss=total / self.world_size, applied=applied, grad_norm=grad_norm, votes=tuple(summed),
                           keys=keys, data_wait_s=data_wait, patch_accuracy=hits / predicted if predicted else None)

    def _on_device(self, values: list[float]) -> torch.Tensor:
        """The votes on the device without waiting for it. A copy from pageable memory makes torch synchronise
        the stream: issued once the backward pass is queued, it held the host until that pass had run, and the
        GPU then idled while the host queued the update (4-5 ms of a ViT-B/16 step on an H200: the loop ran at
        0.94x the fixed-batch step, which passes no votes). From pinned memory the copy is queued like a kernel."""
        host = torch.tensor(values, dtype=torch.float32)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)
