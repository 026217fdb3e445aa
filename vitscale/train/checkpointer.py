"""When a worker checkpoints, how, and how it leaves after a stop notice.

Cadence: every `train.checkpoint_every` steps, at the last step, and at once on a notice (`stopvote.py`).
A checkpoint is every rank's DeepSpeed shards plus its stream, RNG and train state (`train/checkpoint.py`),
handed to the launcher with the step's metrics; Ray keeps the best by `checkpoint_score`. After a
SIGTERM notice every rank reports once more (each report is a barrier), so the checkpoint is registered
before the told ranks leave, then the attempt ends with `Terminated`.
"""

from __future__ import annotations

import math
import tempfile
import time
from typing import TYPE_CHECKING, Any

from vitscale.data.storage.cleanup import scratch_folder
from vitscale.train import checkpoint as ckpt
from vitscale.train.metrics import StepMetrics
from vitscale.train.stopvote import Notice
from vitscale.train.termination import Terminated

if TYPE_CHECKING:
    from vitscale.train.observers import Observers
    from vitscale.train.worker import Worker


SCRATCH_PREFIX = "vitscale-ckpt-"
"""The local folders a rank saves its checkpoint part into before Ray copies it into the run's storage."""


def checkpoint_score(step: int, first_skipped: int | None) -> float:
    """The score Ray's checkpoint rotation keeps the best of (`launch/ray_train.py`).

    The step, until a step has been skipped as non-finite; from then on every checkpoint scores
    below every earlier one, so rotation never deletes the last checkpoint written before the
    first bad step (Ray always keeps the newest besides).
    """
    return float(step) if first_skipped is None or step < first_skipped else float(step) - 2.0**50


def report_metrics(m: StepMetrics) -> dict[str, Any]:
    """A step's metrics as the launcher gets them: unset ones left out, non-finite ones as None."""
    out = {k: v for k, v in m.__dict__.items() if v is not None}
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


class Checkpointer:
    """Owns the checkpoint cadence, the save and report, and the leave-after-notice barrier."""

    def __init__(self, worker: Worker, observers: Observers) -> None:
        self.worker, self.observers = worker, observers
        self.every, self.total_steps = worker.job.train.checkpoint_every, worker.total_steps

    def due(self, step: int, notice: Notice | None) -> bool:
        return step % self.every == 0 or step == self.total_steps or notice is not None

    def save(self, state: ckpt.TrainState, metrics: StepMetrics, scores: dict[str, float]) -> None:
        """Checkpoint `state` on every rank and report it with the step's metrics and scores."""
        w = self.worker
        self.observers.flush()
        t_save = time.perf_counter()
        stream_state = w.stream_state(state.step)
        # The error budget's count of the epoch so far (all ranks) goes on after a restart.
        stream_state["skipped"] = w.stream.state_dict()["skipped"] if stream_state["position"] else 0
        report = {**report_metrics(metrics), **self.observers.restart_totals(), "skipped_steps": state.skipped_steps,
                  "checkpoint_score": checkpoint_score(state.step, state.first_skipped_step), **scores}
        _save_and_report(w, state, stream_state, report)
        self.observers.checkpoint_saved(time.perf_counter() - t_save)

    def leave(self, notice: Notice, step: int, metrics: StepMetrics, skipped: int, scores: dict[str, float]) -> None:
        """After a SIGTERM notice's checkpoint: one more report from every rank (each is a barrier: a rank's
        report waits until the launcher took its last one, so the checkpoint is registered before a told
        rank leaves), then end the attempt (at the last step the run is done anyway). After the driver's stop
        request's checkpoint: the same report, then the caller returns (the run ends)."""
        self.worker.ctx.report({**report_metrics(metrics), "skipped_steps": skipped, **scores}, None)
        if step < self.total_steps and notice.stopping:
            self.observers.close()
            raise Terminated(f"rank {self.worker.ctx.rank}: {notice.text}", step, signalled=notice.told)


def _save_and_report(w: Worker, state: ckpt.TrainState, stream_state: dict[str, Any], metrics: dict[str, Any]) -> None:
    ctx = w.ctx
    # Locked while this rank lives: a rank killed mid-save (SIGKILL, OOM, a lost node's process) leaves its
    # part here unlocked, and the next rank to save on this machine removes it (data/storage/cleanup.py).
    with scratch_folder(SCRATCH_PREFIX) as directory:
        # A full disk, here or in the run's storage, is one line naming it and the space needed.
        with ckpt.space_for(tempfile.gettempdir(), step=state.step):
            # Every rank calls save: ZeRO keeps one optimizer shard per rank (DeepSpeed barriers inside).
            w.engine.save_checkpoint(str(directory / ckpt.DEEPSPEED_DIR), tag=ckpt.DEEPSPEED_TAG)
            ckpt.write_rank_part(directory, rank=ctx.rank, stream_state=stream_state, train_state=state,
                                 config_yaml=w.job.checkpoint_yaml(w.trained_on),
                                 polyak=None if w.polyak is None else w.polyak.state_dict())
        with ckpt.space_for(ctx.storage or ctx.run_dir, step=state.step, parts=ctx.world_size, copying=directory):
            ctx.report(metrics, directory)
        ckpt.record_part(directory)
