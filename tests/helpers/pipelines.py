"""Tiny one-stage pre-training pipelines for the tests that run `vitscale run` for real (signals, addresses,
orphans, `ray job`): a one-block ViT on a small dataset, one CPU worker, the run under `folder/runs`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

TINY_VIT = {"name": "ViT-Ti/16", "img_size": 32, "depth": 1, "width": 32, "mlp_dim": 64, "heads": 2}
"""One block of width 32 on 32-px images: a step takes milliseconds on a CPU."""


def tiny_pipeline(folder: Path, name: str, data: str | dict[str, Any], train: dict[str, Any],
                  cluster: dict[str, Any] | None = None, model: dict[str, Any] | None = None) -> Path:
    """`folder/NAME.yaml`: pre-train `model` (:data:`TINY_VIT`) on `data` (a dataset's location, read without
    loader processes, or a whole `data:` section) with `train`'s settings (fp32, batches of 8 unless given),
    on one CPU worker of a 2-CPU local Ray (`cluster` overrides it), the run in `folder/runs/NAME`."""
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "stages": ["pretrain"],
        "data": {"url": data, "num_workers": 0} if isinstance(data, str) else data,
        "model": model or TINY_VIT,
        "train": {"global_batch": 8, "micro_batch": 8, "precision": "fp32", **train},
        "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "local_num_cpus": 2,
                    "storage_path": str(folder / "runs"), **(cluster or {})},
    }))
    return path
