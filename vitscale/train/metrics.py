"""Per-step training metrics: a JSONL file per rank and a Prometheus endpoint per process.

What a step reports is one frozen :class:`StepMetrics`. :class:`MetricsSink` writes it

* as one JSON line to ``<run_dir>/metrics/rank<rank>.jsonl`` (written per line, so ``tail -f`` and
  a crash both see every finished step; a line is appended whole or not at all, so a full disk never
  leaves a torn one: ``data/storage/atomic.py``), and
* to Prometheus series (``train/prometheus.py``), served from this process when a port is given, on a
  registry of its own (never the global default registry, so two sinks in one process — tests, Ray Tune
  trials — do not collide).

Prometheus series (labels ``run`` and ``rank`` on all; base units; ``_total`` for counters). ``run`` is the
pipeline run and the Train run's part inside it (``vit-b16``, ``vit-b16/finetune``,
``vit-b16/sweep/trials/<id>``: ``RunPlace.label``):

==================================  =========  =====================================================
name                                type       meaning
==================================  =========  =====================================================
vitscale_step                       gauge      last optimiser step recorded
vitscale_epoch                      gauge      fractional epoch
vitscale_train_loss                 gauge      training loss of the last step
vitscale_learning_rate              gauge      learning rate of the last step
vitscale_grad_norm                  gauge      global gradient norm before clipping
vitscale_images_per_second          gauge      throughput of the last step (global batch / step time)
vitscale_step_seconds               histogram  wall time per optimiser step
vitscale_data_wait_seconds          histogram  part of the step spent waiting for input
vitscale_compute_seconds            histogram  part of the step spent in forward/backward/update
vitscale_examples_seen_total        counter    examples this process consumed (from 0 at its start)
vitscale_train_flops_total          counter    training FLOPs this process spent (FLOPs, not exa)
vitscale_run_flops                  gauge      training FLOPs of the run so far, the paper's count (the
                                               progress line's EFLOP, in FLOPs)
vitscale_mfu_ratio                  gauge      model FLOPs utilisation in [0, 1]; absent if unknown
vitscale_skipped_samples_total      counter    undecodable samples skipped, label ``shard``
vitscale_nonfinite_loss_total       counter    steps whose loss was NaN or infinite
vitscale_checkpoint_seconds         histogram  wall time to save one checkpoint (this rank's part)
vitscale_last_checkpoint_timestamp  gauge      Unix time the last checkpoint save finished
_seconds                                       (absent until this process saved one)
vitscale_attempt_start_timestamp    gauge      Unix time this attempt of the run began (a start or a
_seconds                                       restart): its steps are unsaved until its first checkpoint
vitscale_world_size                 gauge      workers training the run (an elastic run's changes)
vitscale_restarts_total             counter    restarts of the worker group seen by this process
vitscale_restart_lost_seconds_total counter    seconds from the last step before a restart to the
                                               first step after (failure, preemption or resize)
==================================  =========  =====================================================

The counters count what this process did, as Prometheus expects of a counter: a restart of the worker
group is a new process whose counters start at 0, which ``rate()`` and ``increase()`` read as the reset it
is. (Counting from the checkpoint's totals instead, a restart on the same scrape target dropped the series
from the last step's total to the checkpoint's, and ``increase()`` took the whole run's examples for new
ones.) The run's own totals are the JSON lines' and, for compute, ``vitscale_run_flops``.

The alert rules and Grafana dashboard built on these series are in ``k8s/monitoring/``.

Rank 0 also writes TensorBoard event files (``train/tensorboard.py``) and prints a progress line
(``train/progress.py``) from the same :class:`StepMetrics`.

Every JSON line also holds ``world_size``, ``attempt`` (when the worker group started) and ``launch`` (when
the command running it began): :func:`vitscale.train.restarts.restarts` reads a rank's lines back into each
restart's step, steps redone, seconds lost and world sizes, and the run's summary keeps ``restarts``,
``relaunches`` (those by running the command again) and ``restart_lost_s``.

The histograms' ``_sum`` series let a dashboard compute the input-bound fraction as
``rate(vitscale_data_wait_seconds_sum[5m]) / rate(vitscale_step_seconds_sum[5m])``.

MFU (`train/mfu.py`) is left out where the device's peak is unknown (a CPU, a GPU not in its table): JSON
``null``, no Prometheus sample, rather than made up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from vitscale.config.checks import check, non_negative_int
from vitscale.data.storage.atomic import AppendOnly
from vitscale.train.prometheus import MetricsServer, PrometheusSeries
from vitscale.train.restarts import Restart, read_rows, restarts

__all__ = [
    "MetricsSink",
    "StepClock",
    "StepMetrics",
    "metrics_path",
]

@dataclass(frozen=True)
class StepMetrics:
    """What one optimiser step reports. Times are seconds; counts are cumulative since the run began."""

    step: int
    """Optimiser steps completed (1 after the first update)."""
    loss: float
    """Training loss of this step (mean over the global batch if the loop reduced it)."""
    lr: float
    """Learning rate used by this step."""
    grad_norm: float
    """Global gradient norm before clipping (NaN if the engine did not compute it)."""
    images_per_s: float
    """Training throughput of this step: global batch / step wall time (all ranks together)."""
    step_time_s: float
    """Wall time of the whole step, data wait and the previous step's bookkeeping included (`StepClock`)."""
    data_wait_s: float
    """Time blocked waiting for the next batch."""
    compute_s: float
    """The step's time less its data wait: forward, backward, the update and the loop's own work."""
    examples_seen: int
    """Examples consumed by the whole run (all ranks) so far."""
    cumulative_exaflops: float
    """Training compute so far, in exaFLOPs (1e18), by the paper's convention (3x forward)."""
    mfu: float | None
    """Model FLOPs utilisation in [0, 1], or None where the hardware peak is unknown (CPU)."""
    skipped_samples: int
    """Samples skipped so far (undecodable images, bad labels) on this rank, by this process."""
    epoch: float
    """Fractional epoch reached."""
    world_size: int = 1
    """Workers training this step (an elastic run's changes over time)."""
    attempt: float = 0.0
    """Unix time this attempt of the run (a start or a restart of the worker group) began: a new value in
    a rank's lines marks a restart (:func:`restarts`)."""
    launch: float = 0.0
    """Unix time the command running this attempt began (`vitscale run`): the same through the restarts Ray
    Train makes, a new value when the run is resumed by running the command again (0: not known)."""
    run_skipped_samples: int = 0
    """Samples the whole run skipped so far: all ranks, every epoch, the attempts before a restart included (as
    far as the checkpoint it resumed from; the run's summary shows this)."""
    patch_accuracy: float | None = None
    """Masked patch prediction (Sec. 4.6): the share of this step's corrupted patches (all ranks) whose
    target was predicted exactly; None for supervised training and the regression target."""


class StepClock:
    """A step's wall time, its own bookkeeping included: the loop's work after a step's last read of the
    device (metrics lines, TensorBoard, the progress line) leaves the GPU idle as much as the step itself
    does, so it counts in the next step's time; evaluations and checkpoints do not (their steps are rare,
    and their cost is in the run's wall time and the timing lines they print)."""

    def __init__(self) -> None:
        self.taken = time.perf_counter()
        self.carry = 0.0

    def start(self) -> None:
        """A step begins: its time runs from the end of the previous one, plus that one's bookkeeping."""
        self.begun = time.perf_counter() - self.carry

    def lap(self) -> float:
        """The step's read is done: seconds since `start`, the previous step's bookkeeping included."""
        self.taken = time.perf_counter()
        return self.taken - self.begun

    def booked(self) -> None:
        """The step's bookkeeping is done: its seconds go into the next step's time."""
        self.carry = time.perf_counter() - self.taken


_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepMetrics))


def _json_safe(value: object) -> object:
    # NaN/inf are not JSON (json.dumps would write bare NaN that strict readers reject): write null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def metrics_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` of the run in `run_dir` writes its step lines, every attempt continuing the file."""
    return Path(run_dir) / "metrics" / f"rank{rank}.jsonl"


class MetricsSink:
    """Writes :class:`StepMetrics` to ``run_dir/metrics/rank{rank}.jsonl`` and, optionally, Prometheus.

    Args:
        run_dir: the run directory; ``metrics/`` is created inside it. Lines are appended, so a
            resumed run continues the same file (steps may repeat after a restore; the last line
            for a step wins).
        run: the run name, the ``run`` label of every series.
        rank: this worker's global rank, the ``rank`` label and part of the file name.
        port: serve ``/metrics`` on this port from this process; 0 picks a free port (read it back
            from :attr:`port`); None serves nothing.
        addr: the interface to bind (``train.metrics_addr``): loopback by default, so a laptop's
            metrics are not served to its network; ``0.0.0.0`` lets a Prometheus in the cluster
            scrape the pod (the k8s manifests set it).
        resumed_examples, resumed_exaflops: the run's totals at the step this process starts from (its
            checkpoint's): the counters count from there.

    The series and their counters' arithmetic are `train/prometheus.py`'s.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        run: str,
        rank: int,
        port: int | None = None,
        addr: str = "127.0.0.1",
        resumed_examples: int = 0,
        resumed_exaflops: float = 0.0,
    ) -> None:
        non_negative_int(rank, "rank")
        if port is not None:
            check(non_negative_int(port, "metrics port") <= 65535, "metrics port",
                  f"must be an integer in [0, 65535] or None, got {port!r}")
        self.run = run
        self.rank = rank
        self.path = metrics_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The previous attempt's last line (a restart continues the file): the first line of this one is
        # compared with it (`restarts`).
        earlier = read_rows(self.path)
        self._previous: dict[str, object] | None = earlier[-1] if earlier else None
        self.restarts: list[Restart] = restarts(earlier)
        """Every restart of the run in this rank's lines so far, earlier attempts' included (read once at
        open, then added to as lines are recorded: never re-read on the step path)."""
        # Whole lines or nothing (data/storage/atomic.py): a full disk or a killed writer never leaves a torn
        # line for the next attempt to continue from; a torn one an earlier writer left is cut off here.
        self._file: AppendOnly | None = AppendOnly(self.path)
        self._lock = threading.Lock()
        self.prometheus = PrometheusSeries(run, rank, resumed_examples=resumed_examples,
                                           resumed_exaflops=resumed_exaflops)
        self.registry = self.prometheus.registry
        self.server = MetricsServer(self.registry, port, addr) if port is not None else None
        """`/metrics` served from this process; None where no port was asked for."""
        self.port: int | None = self.server.port if self.server else None
        self.refused: str | None = self.server.refused if self.server else None
        """Why the port asked for could not be served (another process holds it), when another one is."""

    def record(self, m: StepMetrics, skipped_by_shard: dict[str, int] | None = None) -> None:
        """Write one step: a JSON line (flushed) and, if serving, the Prometheus series.

        ``skipped_by_shard`` maps shard name → samples skipped in that shard so far (cumulative,
        like ``m.skipped_samples``). Skips not attributed to a shard are counted under
        ``shard="unknown"``, so the sum over ``shard`` always equals ``m.skipped_samples``.

        Raises:
            ValueError: the sink is closed, or a shard count is negative.
        """
        if self._file is None:
            raise ValueError("MetricsSink.record() after close()")
        by_shard = dict(skipped_by_shard or {})
        if any(v < 0 for v in by_shard.values()):
            raise ValueError(f"skipped_by_shard counts must be >= 0, got {by_shard}")
        # The "unknown" series always exists (at 0 until a skip), so increase() alerts see the first skip.
        unattributed = max(0, m.skipped_samples - sum(by_shard.values()))
        by_shard["unknown"] = by_shard.get("unknown", 0) + unattributed

        row = {"time": time.time(), "run": self.run, "rank": self.rank}
        row.update({k: _json_safe(getattr(m, k)) for k in _STEP_FIELDS})  # asdict's deep copies: half the call
        if skipped_by_shard:
            row["skipped_by_shard"] = dict(skipped_by_shard)
        with self._lock:
            self._file.append(json.dumps(row, allow_nan=False))
            gone = restarts([self._previous, row]) if self._previous is not None else []
            self._previous = row
            self.restarts.extend(gone)

            self.prometheus.record(m, by_shard, gone)

    def checkpoint_saved(self, seconds: float, finished_at: float | None = None) -> None:
        """Record a finished checkpoint save: how long it took and when it finished (Unix time, default now).

        Raises:
            ValueError: the sink is closed, or ``seconds`` is negative or not finite.
        """
        if self._file is None:
            raise ValueError("MetricsSink.checkpoint_saved() after close()")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"checkpoint seconds must be a finite number >= 0, got {seconds!r}")
        with self._lock:
            self.prometheus.checkpoint_saved(seconds, finished_at)

    def close(self) -> None:
        """Stop the HTTP server (if any) and close the JSONL file. Safe to call twice."""
        with self._lock:
            if self.server is not None:
                self.server.close()
                self.server = None
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
