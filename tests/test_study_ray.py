"""A scaling study on a real local Ray, driven through `vitscale run` as a user would.

Three tiny cells, one at a time. The driver is SIGKILLed once the first cell is done and the
second has started; the same command run again skips the finished cell (its record untouched),
resumes the interrupted one, and runs the third, whose first run fails (an injected fault) and is
retried. The table, the Figure-5 plot and the fits file are there at the end; `vitscale study
report` regenerates them from the state alone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from helpers.ray_runs import RUN_TIMEOUT_S, VITSCALE, kill_tree, run, start
from vitscale.data.tools.write import write_dataset

pytestmark = pytest.mark.slow
pytest.importorskip("ray")

TINY = {"name": "ViT-Ti/8", "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2}


def _pipeline(tmp_path: Path) -> Path:
    pre, digits = tmp_path / "pre", tmp_path / "digits"
    write_dataset("synthetic", str(pre), shard_size=100, seed=0,
                  source_options={"count": 160, "classes": 4, "image_size": 16})
    write_dataset("digits", str(digits), shard_size=500, seed=0, splits={"train": 0.8, "test": 0.2})
    raw = {
        "name": "tiny-study", "stages": ["study"],
        "model": {"name": "ViT-Ti/8", "img_size": 16},
        "data": {"url": str(pre), "num_workers": 0, "shuffle_buffer": 64},
        "train": {"global_batch": 16, "micro_batch": 16, "epochs": 1, "warmup_steps": 1, "precision": "fp32",
                  "zero_stage": 0, "checkpoint_every": 2, "log_every": 2},
        "fewshot": {"datasets": [str(digits)], "shots": [2], "seeds": 1, "resolution": 16},
        "study": {"models": [TINY], "data_sizes": [64, None], "max_concurrent": 1, "retries": 1,
                  # Its first run dies at step 2 (the fault fires on a run's first attempt only).
                  "cells": [{"model": {**TINY, "width": 48, "train": {"fault": {"kill_rank": 0, "kill_at_step": 2}}}}]},
        "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "local_num_cpus": 2, "max_failures": 0,
                    "storage_path": str(tmp_path / "runs")},
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _records(study: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (study / "state").glob("*.json") if ".stages" not in p.name}


def test_study_interrupted_and_run_again(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path)
    study = tmp_path / "runs" / "tiny-study" / "study"
    plan = json.loads(run_cli(["study", "plan", str(pipeline), "--json"]))
    first, second, third = (c["id"] for c in plan)

    log = tmp_path / "first.log"
    proc = start(pipeline, log)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while f"cell {second}: started" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the second cell never started"
            time.sleep(1)
        # Until the driver has written the running attempt's time once (its heartbeat), so the kill
        # leaves a time on record that the next run must count.
        while not _records(study).get(second, {}).get("open_attempt_s"):
            assert time.monotonic() < deadline, "no heartbeat of the second cell"
            time.sleep(1)
    finally:
        assert not kill_tree(proc)
    before = _records(study)
    assert before[first]["status"] == "done" and before[first]["runs"] == 1
    assert before[second]["status"] == "running"
    assert third not in before or before[third]["status"] == "pending"

    output = run(pipeline, tmp_path / "second.log")
    assert "3 cells, 1 done, 2 to run (1 resumed)" in output
    after = _records(study)
    assert after[first] == before[first]  # not run again
    assert after[second]["status"] == "done" and after[second]["runs"] == 2
    # Time over every attempt: the killed one's last heartbeat is in the sums.
    assert after[second]["wall_s"] > before[second]["open_attempt_s"] > 0
    assert after[second]["device_hours"] == pytest.approx(after[second]["wall_s"] / 3600 * after[second]["devices"])
    assert after[second]["open_attempt_s"] == 0
    assert after[third]["status"] == "done" and (after[third]["runs"], after[third]["failures"]) == (2, 1)
    assert f"cell {third}: failed" in output and "running it again" in output
    for record in after.values():
        assert record["exaflops"] > 0 and record["examples_seen"] > 0
        assert 0.0 <= record["accuracies"]["digits fewshot 2shot"] <= 1.0
    assert after[second]["examples_seen"] == after[third]["examples_seen"] == 160 // 16 * 16
    assert after[first]["examples_seen"] == 64 // 16 * 16  # the subset, not the split

    table = (study / "results.md").read_text()
    assert all(cell in table for cell in (first, second, third))
    assert (study / "compute_vs_accuracy.png").stat().st_size > 0 and (study / "data_size_vs_accuracy.png").exists()
    assert "a fit of 4 parameters needs at least 5" in (study / "fits.md").read_text()
    assert (study / "frontier.md").exists() and (study / "backtest.md").exists()
    rows = {r["cell"]: r for r in json.loads(run_cli(["study", "report", str(study), "--json"]))["rows"]}
    assert rows[first]["planned_device_hours"] > 0 and rows[first]["pretrain_device_hours"] > 0

    (study / "results.md").unlink()
    report = run_cli(["study", "report", str(study), "--json"])
    assert len(json.loads(report)["rows"]) == 3 and (study / "results.md").exists()

    # The probe's dataset written again (other digits, the same counts): the finished cells' accuracies are the
    # old data's, so the same command is refused in one line, before Ray starts, and no record changes.
    plan_file = json.loads((study / "plan.json").read_text())
    assert set(plan_file["datasets"]) == {str(tmp_path / "pre"), str(tmp_path / "digits")}
    shutil.rmtree(tmp_path / "digits")
    write_dataset("digits", str(tmp_path / "digits"), shard_size=500, seed=1, splits={"train": 0.8, "test": 0.2})
    refused = subprocess.run([VITSCALE, "run", str(pipeline)], capture_output=True, text=True, timeout=300)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and lines[0].startswith("vitscale: error: fewshot.datasets[0]: "), \
        refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "as before, other shards or labels" in lines[0] and "started a local Ray" not in refused.stdout
    assert _records(study) == after


def run_cli(args: list[str]) -> str:
    return subprocess.run([VITSCALE, *args], capture_output=True, text=True, check=True).stdout
