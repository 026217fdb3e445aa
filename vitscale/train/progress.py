"""Rank 0's progress line on the terminal: wall-clock time, step, epoch, loss, rate, compute and an ETA."""

from __future__ import annotations

import math
import time

from vitscale.say import line
from vitscale.train.metrics import StepMetrics


def hms(seconds: float) -> str:
    """`H:MM:SS` (hours unbounded) of a non-negative duration, rounded to the second; "-:--:--" if unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "-:--:--"
    total = round(seconds)
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def progress_line(m: StepMetrics, total_steps: int, elapsed_s: float, steps_done: int,
                  now: float | None = None) -> str:
    """Rank 0's step line: wall-clock time, step, epoch, loss, LR, throughput, compute and an H:MM:SS ETA.

    The ETA is the mean time of the `steps_done` steps this process ran (`elapsed_s`) times the steps left.
    """
    eta = elapsed_s / max(steps_done, 1) * (total_steps - m.step)
    mfu_text = f" mfu {m.mfu:.1%}" if m.mfu is not None else ""
    patch = f" patch acc {m.patch_accuracy:.1%}" if m.patch_accuracy is not None else ""
    rate = f"{m.images_per_s:.{0 if m.images_per_s >= 10 else 2}f}"  # a big ViT on CPU runs below 1 img/s
    data = m.data_wait_s / m.step_time_s if m.step_time_s > 0 else 0.0
    clock = time.strftime("%H:%M:%S", time.localtime(time.time() if now is None else now))
    return line(f"{clock} step {m.step}/{total_steps} epoch {m.epoch:.2f} loss {m.loss:.4f}{patch} lr {m.lr:.2e} "
                f"{rate} img/s (data {data:.0%}){mfu_text} {m.cumulative_exaflops:.3g} EFLOP eta {hms(eta)}")
