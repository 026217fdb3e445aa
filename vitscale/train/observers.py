"""Everything that watches a worker's steps, behind one `record` and one `close`.

Each step's metrics go to this rank's JSONL file and Prometheus endpoint (`MetricsSink`), rank 0's
TensorBoard curves, the audit log of the sample keys each rank consumed (`train.record_samples`) and
rank 0's progress line on the console. None of them changes what is trained.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from vitscale.data.storage.atomic import AppendOnly
from vitscale.say import say
from vitscale.train.metrics import MetricsSink, StepMetrics
from vitscale.train.progress import progress_line
from vitscale.train.tensorboard import TensorBoardLog

if TYPE_CHECKING:
    from vitscale.train.context import WorkerContext
    from vitscale.train.worker import Worker


class Observers:
    """The metrics sink, TensorBoard, the samples log and the progress line of one worker."""

    def __init__(self, worker: Worker) -> None:
        ctx, train = worker.ctx, worker.job.train
        self.ctx, self.total_steps, self.log_every = ctx, worker.total_steps, train.log_every
        self.start_step = worker.state.step
        self.sink = MetricsSink(ctx.run_dir, run=ctx.run_name or ctx.run_dir.name, rank=ctx.rank,
                                addr=train.metrics_addr, port=None if train.metrics_port is None else
                                (0 if train.metrics_port == 0 else train.metrics_port + ctx.local_rank),
                                resumed_examples=worker.state.examples_seen, resumed_exaflops=worker.state.flops / 1e18)
        if self.sink.port is not None:
            instead = f" instead: {self.sink.refused}" if self.sink.refused else ""
            say(f"rank {ctx.rank}: Prometheus metrics on :{self.sink.port}/metrics{instead}")
        self.samples = SamplesLog(ctx) if train.record_samples else None
        # Rank 0's curves, keyed by optimiser step, in the run directory (pushed to the run's storage with
        # the metrics); a resumed run continues them from its checkpoint's step.
        self.board = TensorBoardLog(ctx.run_dir / "tensorboard", resumed_at=self.start_step) if ctx.rank == 0 else None
        self.attempt = time.time()  # marks this attempt's metrics lines: a restart starts a new one (restarts.py)
        self.started = time.perf_counter()

    def record(self, metrics: StepMetrics, keys: list[str], skipped_by_shard: dict[str, int]) -> None:
        """One step: every sink, and rank 0's progress line every `train.log_every` steps and at the last."""
        self.sink.record(metrics, skipped_by_shard)
        if self.board is not None:
            self.board.record(metrics)
        if self.samples is not None:
            self.samples.write(metrics.step, keys, self.ctx.world_size)
        if self.ctx.rank == 0 and (metrics.step % self.log_every == 0 or metrics.step == self.total_steps):
            print(progress_line(metrics, self.total_steps, time.perf_counter() - self.started,
                                metrics.step - self.start_step), flush=True)

    def scores(self, step: int, scores: dict[str, float]) -> None:
        """Evaluation scores of `step` (TensorBoard; the loop reports them to the launcher)."""
        if self.board is not None and scores:
            self.board.scores(step, scores)

    def flush(self) -> None:
        """Before a checkpoint: the curves so far are on disk, so they travel with it."""
        if self.board is not None:
            self.board.flush()

    def checkpoint_saved(self, seconds: float) -> None:
        self.sink.checkpoint_saved(seconds)

    def restart_totals(self) -> dict[str, Any]:
        """Restarts of the run so far (failures, preemptions, resizes) and the seconds they cost, from this
        rank's metrics lines (every attempt's: the file is continued, on a new node pulled from storage)."""
        restarts = self.sink.restarts
        return {"restarts": len(restarts), "relaunches": sum(r.relaunched for r in restarts),
                "restart_lost_s": round(sum(r.seconds_lost for r in restarts), 1)}

    def close(self) -> None:
        self.sink.close()
        if self.board is not None:
            self.board.close()


class SamplesLog:
    """Keys consumed per step and rank: proves no sample is repeated or skipped across a resume.

    Lines are appended; after a resume the steps since the checkpoint are written again, and the
    last line for a step is the one whose update survives in the weights.
    """

    def __init__(self, ctx: WorkerContext):
        directory = ctx.run_dir / "samples"
        directory.mkdir(parents=True, exist_ok=True)
        # Whole lines or nothing (data/storage/atomic.py), as the metrics: a full disk tears no record.
        self.file = AppendOnly(directory / f"rank{ctx.rank}.jsonl")

    def write(self, step: int, keys: list[str], world_size: int) -> None:
        # The world size and time say which attempt's lines survive when an elastic run resized.
        self.file.append(json.dumps({"step": step, "keys": keys, "world_size": world_size,
                                     "time": round(time.time(), 3)}))
