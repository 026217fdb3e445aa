"""docs/examples/ray_train_loop.py, a user's own Ray Train loop on vitscale shards, run for real:
a local Ray, 2 CPU workers on gloo, shards a DatasetWriter wrote."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from vitscale.data import DatasetWriter

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # Ray's start and two worker processes: ~40 s on 2 cores

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "ray_train_loop.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ray_train_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, log_to_driver=False)  # always our own, never a cluster found on this machine
    yield
    ray.shutdown()


def test_example_trains_two_workers_and_checkpoints_the_stream(local_ray: None, tmp_path: Path) -> None:
    data = tmp_path / "shards"
    rng = np.random.default_rng(0)
    with DatasetWriter(str(data), name="blobs", classes=["dark", "light"], shard_size=30) as w:
        for i in range(100):  # 50 a rank: 6 batches of 8 per epoch
            level = 40 if i % 2 == 0 else 210
            w.add(np.clip(rng.normal(level, 20, (24, 24, 3)), 0, 255).astype(np.uint8), i % 2)
    result = _example().main([
        "--data", str(data), "--workers", "2", "--steps", "4", "--checkpoint-every", "2", "--batch", "8",
        "--resolution", "16", "--depth", "1", "--width", "32", "--storage", str(tmp_path / "runs"),
        "--name", "example",
    ])
    assert result.error is None and result.metrics["step"] == 4 and np.isfinite(result.metrics["loss"])
    with result.checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / "state.pt", weights_only=True)  # tensors and plain data: no pickled code runs
    assert state["step"] == 4
    # Each rank's position in its own share of epoch 0: 4 batches of 8 read.
    assert state["data"] == [{"epoch": 0, "position": 32, "seed": 0}] * 2
