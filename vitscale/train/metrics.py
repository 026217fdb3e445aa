"""Per-step training metrics: a JSONL file per rank and a Prometheus endpoint per process.

What a step reports is one frozen :class:`StepMetrics`. :class:`MetricsSink` writes it

* as one JSON line to ``<run_dir>/metrics/rank<rank>.jsonl`` (written per line, so ``tail -f`` and
  a crash both see every finished step; a line is appended whole or not at all, so a full disk never
  leaves a torn one: ``data/storage/atomic.py``), and
* when a port is given, to Prometheus series served from this process by
  ``prometheus_client.start_http_server`` on a registry of its own (never the global default
  registry, so two sinks in one process — tests, Ray Tune trials — do not collide).

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

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from vitscale.config.checks import check, non_negative_int
from vitscale.data.storage.atomic import AppendOnly
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


# Step times span milliseconds (tiny CPU runs) to a minute (huge models, slow storage).
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
# Checkpoints: a tiny CPU model in well under a second to ZeRO-3 shards of a huge one on slow storage.
_CHECKPOINT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 180.0, 600.0, 1800.0, float("inf"))


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

    Counters are fed cumulative values (``examples_seen``, ``cumulative_exaflops``, skipped counts)
    and increase by the difference from the previous record (the first from the resumed totals); a
    value lower than the last one (a restore to an earlier checkpoint in the same process) adds
    nothing, as counters cannot go down.
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
        # Cumulative value last fed to each counter child: the counters start at 0 where this process starts.
        self._last: dict[str, float] = {"examples": float(resumed_examples), "flops": resumed_exaflops * 1e18}
        self.registry = CollectorRegistry(auto_describe=True)
        self._build_series()
        self._server = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self.refused: str | None = None
        """Why the port asked for could not be served (another process holds it), when another one is."""
        if port is not None:
            try:
                started = start_http_server(port, addr=addr, registry=self.registry)
            except OSError as exc:
                if port == 0:
                    raise
                # Another process on this node holds the port (a peer's run, an exporter): a run of days is not
                # stopped, nor restarted until its failures are spent, for its metrics' port. A free one serves
                # them instead, and the worker says which (`Observers`).
                self.refused = f"port {port} could not be served ({exc.strerror or exc})"
                started = start_http_server(0, addr=addr, registry=self.registry)
            if started is None:  # prometheus-client < 0.20 returns nothing: the server could never stop
                raise RuntimeError("MetricsSink needs prometheus-client >= 0.20 "
                                   "(start_http_server must return the server)")
            self._server, self._thread = started
            self.port = int(self._server.server_port)

    def _build_series(self) -> None:
        labels = ("run", "rank")
        r = self.registry
        self._g = {
            "step": Gauge("vitscale_step", "Last optimiser step recorded.", labels, registry=r),
            "epoch": Gauge("vitscale_epoch", "Fractional epoch reached.", labels, registry=r),
            "loss": Gauge("vitscale_train_loss", "Training loss of the last step.", labels, registry=r),
            "lr": Gauge("vitscale_learning_rate", "Learning rate of the last step.", labels, registry=r),
            "grad_norm": Gauge("vitscale_grad_norm", "Global gradient norm before clipping.", labels, registry=r),
            "images_per_s": Gauge(
                "vitscale_images_per_second", "Training examples per second in the last step (all ranks).", labels,
                registry=r,
            ),
        }
        self._mfu = Gauge("vitscale_mfu_ratio", "Model FLOPs utilisation (0-1) vs dense bf16 peak.", labels, registry=r)
        self._patch = Gauge("vitscale_patch_accuracy_ratio",
                            "Masked patch prediction: share of the last step's corrupted patches predicted exactly.",
                            labels, registry=r)
        self._h = {
            "step_time_s": Histogram(
                "vitscale_step_seconds", "Wall time per optimiser step.", labels, buckets=_SECONDS_BUCKETS,
                registry=r,
            ),
            "data_wait_s": Histogram(
                "vitscale_data_wait_seconds", "Time per step waiting for input.", labels, buckets=_SECONDS_BUCKETS,
                registry=r,
            ),
            "compute_s": Histogram(
                "vitscale_compute_seconds", "Time per step in forward, backward and update.", labels,
                buckets=_SECONDS_BUCKETS, registry=r,
            ),
        }
        # This sink's own series of every step, looked up once (a labels() call takes a lock and a dict lookup).
        self._step_gauges = {key: gauge.labels(self.run, str(self.rank)) for key, gauge in self._g.items()}
        self._step_histograms = {key: hist.labels(self.run, str(self.rank)) for key, hist in self._h.items()}
        # prometheus_client appends "_total" to counter names itself.
        self._examples = Counter("vitscale_examples_seen", "Examples this process consumed.", labels, registry=r)
        self._flops = Counter("vitscale_train_flops", "Training FLOPs this process spent.", labels, registry=r)
        for counter in (self._examples, self._flops):
            counter.labels(self.run, str(self.rank))  # at 0 from the start: a restart's reset is seen at once
        self._run_flops = Gauge("vitscale_run_flops", "Training FLOPs of the run so far (the paper's count).", labels,
                                registry=r)
        self._skipped = Counter(
            "vitscale_skipped_samples", "Samples skipped (undecodable or invalid), by shard.", (*labels, "shard"),
            registry=r,
        )
        self._nonfinite = Counter("vitscale_nonfinite_loss", "Steps whose loss was NaN or infinite.", labels,
                                  registry=r)
        self._nonfinite.labels(self.run, str(self.rank))  # at 0 from the start, so increase() sees the first one
        self._ckpt_time = Histogram(
            "vitscale_checkpoint_seconds", "Wall time to save one checkpoint (this rank's part).", labels,
            buckets=_CHECKPOINT_BUCKETS, registry=r,
        )
        self._world = Gauge("vitscale_world_size", "Workers training the run (changes when an elastic run resizes).",
                            labels, registry=r)
        self._restarts = Counter("vitscale_restarts", "Restarts of the worker group this process has seen begin "
                                 "(failures, preemptions, resizes).", labels, registry=r)
        self._restart_seconds = Counter("vitscale_restart_lost_seconds", "Seconds from the last step before a "
                                        "restart to the first step after.", labels, registry=r)
        # At 0 from the start, as the non-finite count: a series that first appears at 1 is one whose first
        # sample increase() and rate() never count, so a restart (always a new process's) would not show.
        for counter in (self._restarts, self._restart_seconds):
            counter.labels(self.run, str(self.rank))
        self._attempt = Gauge("vitscale_attempt_start_timestamp_seconds", "Unix time this attempt of the run (a start "
                              "or a restart of the worker group) began.", labels, registry=r)
        self._ckpt_last = Gauge(
            "vitscale_last_checkpoint_timestamp_seconds", "Unix time the last checkpoint save finished.", labels,
            registry=r,
        )

    def _advance(self, key: str, counter_child: Counter, cumulative: float) -> None:
        delta = cumulative - self._last.get(key, 0.0)
        if delta > 0:
            counter_child.inc(delta)
        self._last[key] = max(cumulative, self._last.get(key, 0.0))

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

            lv = (self.run, str(self.rank))
            values = {"step": m.step, "epoch": m.epoch, "loss": m.loss, "lr": m.lr, "grad_norm": m.grad_norm,
                      "images_per_s": m.images_per_s}
            for key, gauge in self._step_gauges.items():
                gauge.set(values[key])  # NaN is a legal Prometheus value: shows a diverged loss
            if m.mfu is not None and math.isfinite(m.mfu):
                self._mfu.labels(*lv).set(m.mfu)
            if m.patch_accuracy is not None:
                self._patch.labels(*lv).set(m.patch_accuracy)
            for key, hist in self._step_histograms.items():
                hist.observe(getattr(m, key))
            self._advance("examples", self._examples.labels(*lv), float(m.examples_seen))
            self._advance("flops", self._flops.labels(*lv), m.cumulative_exaflops * 1e18)
            self._run_flops.labels(*lv).set(m.cumulative_exaflops * 1e18)
            for shard, count in by_shard.items():
                self._advance(f"skipped/{shard}", self._skipped.labels(*lv, shard), float(count))
            if not math.isfinite(m.loss):
                self._nonfinite.labels(*lv).inc()
            self._world.labels(*lv).set(m.world_size)
            if m.attempt > 0:
                self._attempt.labels(*lv).set(m.attempt)
            for restart in gone:
                self._restarts.labels(*lv).inc()
                self._restart_seconds.labels(*lv).inc(restart.seconds_lost)

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
            lv = (self.run, str(self.rank))
            self._ckpt_time.labels(*lv).observe(seconds)
            self._ckpt_last.labels(*lv).set(time.time() if finished_at is None else finished_at)

    def close(self) -> None:
        """Stop the HTTP server (if any) and close the JSONL file. Safe to call twice."""
        with self._lock:
            if self._server is not None:
                self._server.shutdown()  # ends serve_forever in the daemon thread
                self._server.server_close()  # releases the port
                if self._thread is not None:
                    self._thread.join(timeout=5)
                self._server = None
                self._thread = None
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
