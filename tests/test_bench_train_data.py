"""benchmarks/train_data.py on CPU, tiny: writes JPEGs and shards, runs the real worker loop on them and the
fixed-batch peer, and reports finite figures for both (the GPU-sized run is the benchmark itself)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_data.py"


def test_tiny_run_reports_loop_and_fixed_batch_throughput(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    # A subprocess: the run sets up a process group and MASTER_* variables this test process must not keep.
    # CUDA hidden: the same tiny CPU run on a machine with a GPU.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--images", "64", "--jpeg-size", "48", "--classes", "8", "--batch", "8",
         "--steps", "4", "--loader-workers", "1", "--fixed-steps", "2", "--decode-seconds", "0.5",
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]

    results = json.loads(out.read_text())
    assert results["data"]["images"] == 64 and results["data"]["written"]
    fixed = results["fixed_batch"]["images_per_s"]
    assert math.isfinite(fixed) and fixed > 0
    [row] = results["rows"]
    loop = row["loop"]
    assert row["loader_workers"] == 1
    assert math.isfinite(loop["images_per_s"]) and loop["images_per_s"] > 0
    assert loop["steps"] == 4 and loop["summary_steps"] == 4  # every step reported, the loop ran them all
    assert loop["steady_steps"] == 3  # the first quarter (one step) left out
    assert math.isclose(row["ratio"], loop["images_per_s"] / fixed)
    assert loop["loader_processes"] == 1
    assert row["decode"]["images_per_s"] > 0

    # One JSON line per measurement on stdout, then the table row.
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [line["measure"] for line in lines] == ["data", "fixed_batch", "loop", "decode"]
    assert any(line.startswith("| 1 | 1 |") for line in done.stdout.splitlines())
