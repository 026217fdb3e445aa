"""The worker loop run in a test's own process: a stand-in for the launcher's report hook, and a checkpoint's
consolidated weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def steps(run_dir: Path, rank: int = 0) -> list[dict]:
    """Every step a rank recorded in the run's metrics file (`metrics/rank{rank}.jsonl`), in order: the
    per-step record (the launcher is handed only checkpoints' and evaluations' metrics)."""
    from vitscale.train.restarts import read_rows

    return read_rows(run_dir / "metrics" / f"rank{rank}.jsonl")


class Recorder:
    """Stands in for the launcher's report hook: every report (a checkpoint's or an evaluation's metrics),
    every checkpoint a rank hands over copied into `keep` (as `checkpoint_{step:09d}`)."""

    def __init__(self, keep: Path):
        self.keep = keep
        self.metrics: list[dict] = []

    def __call__(self, metrics: dict, checkpoint_dir: Path | None) -> None:
        self.metrics.append(metrics)
        if checkpoint_dir is not None:
            self.keep.mkdir(parents=True, exist_ok=True)
            shutil.copytree(checkpoint_dir, self.keep / f"checkpoint_{metrics['step']:09d}")


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's ZeRO state gathered into one fp32 state dict."""
    from vitscale.train.engine import consolidated_state_dict

    return consolidated_state_dict(checkpoint / "deepspeed", "state")
