"""Rank 0's training curves as TensorBoard event files (``<run_dir>/tensorboard/``), keyed by optimiser step.

Scalars: ``train/loss``, ``train/lr``, ``train/images_per_s``, ``train/mfu`` (where
known), ``train/grad_norm``, ``train/epoch``, ``train/exaflops``, ``train/patch_accuracy`` (masked patch
prediction) and every evaluation's accuracy as
``eval/<set>_accuracy``. ``tensorboard --logdir RUN_DIR`` shows a pre-training run, a fine-tune and
every sweep trial the same way; a resumed run continues its curves from the checkpoint's step.
"""

from __future__ import annotations

import time
from pathlib import Path

from vitscale.train.metrics import StepMetrics


def _after_earlier_files(log_dir: Path) -> None:
    """Wait (under a second) until an event file begun now sorts after `log_dir`'s earlier ones. TensorBoard reads
    a run's files in name order: a time in whole seconds, the host, the pid, then a per-process counter compared
    as text, so an attempt resumed in the same second and process as its predecessor (`train()` called again,
    as a test does) could sort first ("...873.vm.26417.10" before "...873.vm.26417.9"), and the predecessor's
    steps past the checkpoint then outlived the purge: the curve went 4, 5, 6, 1, 2, 3, ..."""
    stamps = [int(part) for path in log_dir.glob("events.out.tfevents.*")
              if (part := path.name.split(".")[3]).isdigit()]
    if stamps and max(stamps) >= int(time.time()):
        time.sleep(min(1.0, max(stamps) + 1 - time.time()))


class TensorBoardLog:
    """Rank 0's scalars as TensorBoard event files in `log_dir`, keyed by optimiser step.

    A run resumed from a checkpoint at step S passes ``resumed_at=S``: TensorBoard then drops what an
    earlier attempt logged past S (its ``purge_step``), so the curve goes on from the checkpoint rather
    than folding back or doubling. A start from step 0 purges too: an attempt that died before its first
    checkpoint leaves steps the restart logs again. Events are flushed every 10 s and at every :meth:`flush` (the loop
    calls it before each checkpoint, so storage never holds a checkpoint newer than its curves).
    """

    def __init__(self, log_dir: str | Path, *, resumed_at: int = 0) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # deferred: only rank 0 of a run writes
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import scalar

        self._summary, self._scalar = Summary, scalar  # a step's event is built from them (`_event`)

        self.log_dir = Path(log_dir)
        _after_earlier_files(self.log_dir)  # a restart's file sorts after its predecessor's, which it purges
        self._writer = SummaryWriter(str(self.log_dir), purge_step=resumed_at + 1, flush_secs=10)

    def record(self, m: StepMetrics) -> None:
        """One optimiser step's training scalars."""
        values = {"loss": m.loss, "lr": m.lr, "images_per_s": m.images_per_s, "grad_norm": m.grad_norm,
                  "epoch": m.epoch, "exaflops": m.cumulative_exaflops, "mfu": m.mfu,
                  "patch_accuracy": m.patch_accuracy}
        self._event(m.step, {f"train/{name}": value for name, value in values.items() if value is not None})

    def scores(self, step: int, scores: dict[str, float]) -> None:
        """Evaluation results (``dev_accuracy``, ``test_accuracy_polyak``, ...) at optimiser step `step`."""
        self._event(step, {f"eval/{name}": value for name, value in scores.items()})

    def _event(self, step: int, values: dict[str, float]) -> None:
        """`values` as one event of `step`: what `add_scalar` writes for each, at a fifth of the host's time (one
        event to frame, queue and append instead of eight, between a step's read and the next step's work)."""
        if values:
            summary = self._summary(value=[value for tag, v in values.items() for value in self._scalar(tag, v).value])
            # SummaryWriter's own accessor, the one its add_scalar writes through (it reopens a closed writer).
            self._writer._get_file_writer().add_summary(summary, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
