"""The stop vote: whether this step ends with a checkpoint because a node is going away or the run must end.

Three kinds of notice reach a worker: Ray Train's preemption info (a node is draining; rank 0 asks every
`preemption_every_s`, since asking is a barrier through an actor), a SIGTERM to this process, held
back by `train/termination.py`, and the driver's stop request (Ctrl-C or SIGTERM to `vitscale run`; rank 0
reads it, `launch/stop_request.py`). Every rank must act at the same step, so each rank's vote (rank 0's
"time to ask" and "the driver asks to stop", "I was told to stop") rides in the step's one all-reduce
(`Stepper.step`), and every rank reads the same sums back. `decide` turns them into this step's notice, or
None. The epoch's skipped samples ride in the same sums (the error budget's count); `gather` collects which
shards they came from.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vitscale.say import say

if TYPE_CHECKING:
    from vitscale.train.context import WorkerContext


@dataclass(frozen=True)
class Notice:
    """Checkpoint at this step, because of `text`."""

    text: str
    stopping: int
    """Ranks told to stop (SIGTERM): after the checkpoint they leave, and the others end the attempt too."""
    told: bool
    """This rank is one of them."""
    ending: bool = False
    """The driver asked the run to stop: after the checkpoint every rank returns, and the run ends (kept to be
    resumed at the next step)."""


class StopVote:
    """One worker's side of the vote."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.noticed = False  # a preemption notice was answered with a checkpoint (one per notice is enough)
        self.last_asked = time.monotonic()
        self.told: str | None = None
        self.asked: str | None = None  # rank 0: the driver's stop request, once read
        self.skipped: dict[str, int] = {}
        """This rank's skipped samples per shard (the stream's cumulative counts) as of the last vote: the
        step's own micro-batches, not the next step's first one, read ahead after the vote (`train/feed.py`)."""

    def votes(self, stream: Any) -> list[float]:
        """This rank's votes, taken once the step's micro-batches have run (so a notice that arrived meanwhile
        counts at this step): time for rank 0 to ask Ray, told to stop, the epoch's skipped samples (the
        error budget's count, which rides in the same all-reduce) and, from rank 0, the driver's stop request."""
        ask = self.ctx.rank == 0 and time.monotonic() - self.last_asked >= self.ctx.preemption_every_s
        self.told = self.ctx.terminated()
        if self.ctx.rank == 0 and self.asked is None:
            self.asked = self.ctx.stop_requested()
        self.skipped = stream.skipped()
        return [float(ask), float(self.told is not None), float(stream.epoch_skipped()), float(self.asked is not None)]

    @staticmethod
    def skipped_samples(summed: tuple[float, ...]) -> int:
        """The epoch's skipped samples over all ranks (the error budget's count), from the summed votes."""
        return int(summed[2])

    def gather(self, mine: Mapping[str, int]) -> list[Mapping[str, int]]:
        """Every rank's ``mine`` (its skipped samples per shard), in rank order. A collective: only once the
        summed votes put the epoch over its error budget, which every rank sees at the same step."""
        if self.ctx.world_size == 1 or not torch.distributed.is_initialized():
            return [mine]
        everyone: list[Any] = [None] * self.ctx.world_size
        torch.distributed.all_gather_object(everyone, dict(mine))
        return everyone

    def decide(self, summed: tuple[float, ...], step: int) -> Notice | None:
        """This step's notice from the ranks' summed votes (the same on every rank), or None."""
        ask, stopping = summed[0] > 0, int(summed[1])
        # A preemption notice: checkpoint now rather than lose the steps since the last periodic one; the
        # run goes on until Ray Train restarts it without the preempted node (from this checkpoint).
        text = self.ctx.preemption() if ask and not self.noticed else None
        self.last_asked = time.monotonic() if ask else self.last_asked
        self.noticed = self.noticed or text is not None
        if stopping:  # a told rank leaves after this step's checkpoint: no second notice comes
            text = self.told or f"{stopping} rank(s) received SIGTERM"
        ending = summed[3] > 0
        if ending and not stopping:
            text = self.asked or "the driver asked the run to stop"
        if text is None:
            return None
        if self.ctx.rank == 0 or self.told is not None:
            say(f"step {step}: {text}: checkpointing now")
        return Notice(text, stopping, self.told is not None, ending=ending)
