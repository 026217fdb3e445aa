"""A training process's Prometheus series: one registry per process, served over HTTP where asked.

`train/metrics.py`'s table lists the series; `MetricsSink` feeds them each step's `StepMetrics`. A registry of
its own per sink (never the global default one), so two sinks in one process (tests, Ray Tune trials) do not
collide.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

if TYPE_CHECKING:
    from vitscale.train.metrics import StepMetrics
    from vitscale.train.restarts import Restart

# Step times span milliseconds (tiny CPU runs) to a minute (huge models, slow storage).
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
# Checkpoints: a tiny CPU model in well under a second to ZeRO-3 shards of a huge one on slow storage.
_CHECKPOINT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 180.0, 600.0, 1800.0, float("inf"))


class PrometheusSeries:
    """Every `vitscale_*` series of one process, labelled `run` and `rank`.

    Counters are fed cumulative values (``examples_seen``, ``cumulative_exaflops``, skipped counts) and
    increase by the difference from the previous record (the first from the resumed totals); a value lower
    than the last one (a restore to an earlier checkpoint in the same process) adds nothing, as counters cannot
    go down."""

    def __init__(self, run: str, rank: int, *, resumed_examples: int = 0, resumed_exaflops: float = 0.0) -> None:
        self.run = run
        self.rank = rank
        # Cumulative value last fed to each counter child: the counters start at 0 where this process starts.
        self._last: dict[str, float] = {"examples": float(resumed_examples), "flops": resumed_exaflops * 1e18}
        self.registry = CollectorRegistry(auto_describe=True)
        self._build_series()

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

    def _advance(self, key: str, counter_child: Any, cumulative: float) -> None:
        delta = cumulative - self._last.get(key, 0.0)
        if delta > 0:
            counter_child.inc(delta)
        self._last[key] = max(cumulative, self._last.get(key, 0.0))

    def record(self, m: StepMetrics, by_shard: dict[str, int], gone: list[Restart]) -> None:
        """One step's values; `by_shard` the cumulative skips per shard ("unknown" included), `gone` the restarts
        that ended just before this step."""
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
        """A finished checkpoint save: how long it took and when it finished (Unix time, default now)."""
        lv = (self.run, str(self.rank))
        self._ckpt_time.labels(*lv).observe(seconds)
        self._ckpt_last.labels(*lv).set(time.time() if finished_at is None else finished_at)


class MetricsServer:
    """`registry` served on `/metrics` from this process: on `port` (0: a free one) at `addr`, or, where another
    process holds that port, on a free one, saying why in `refused`."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str) -> None:
        self.refused: str | None = None
        try:
            started = start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            if port == 0:
                raise
            # Another process on this node holds the port (a peer's run, an exporter): a run of days is not
            # stopped, nor restarted until its failures are spent, for its metrics' port. A free one serves
            # them instead, and the worker says which (`Observers`).
            self.refused = f"port {port} could not be served ({exc.strerror or exc})"
            started = start_http_server(0, addr=addr, registry=registry)
        if started is None:  # prometheus-client < 0.20 returns nothing: the server could never stop
            raise RuntimeError("MetricsSink needs prometheus-client >= 0.20 (start_http_server must return the server)")
        self.http, self._thread = started
        self.port = int(self.http.server_port)

    def close(self) -> None:
        """Stop serving and release the port."""
        self.http.shutdown()  # ends serve_forever in the daemon thread
        self.http.server_close()  # releases the port
        if isinstance(self._thread, threading.Thread):
            self._thread.join(timeout=5)
