"""Where a study cell's wall time goes: start-up, training, teardown, transfer.

    python benchmarks/study_overhead.py STUDY_DIR [--json]

Reads a finished local study's state (`state/CELL.json`, `state/CELL.stages.json`) and each
cell's rank-0 metrics (`cells/CELL/metrics/rank0.jsonl`) and splits each cell's (single-run)
wall time into:

- task: the driver starting the cell's Ray task until its pre-training stage begins;
- train start-up: the pre-training stage's start until the first optimiser step begins (Ray Train
  controller and worker actors, imports, process group, data loader, model);
- training: the first step's start to the last step's end (what FLOPs count);
- teardown: the last step to the pre-training stage's end (final checkpoint, Ray Train shutdown);
- transfer: the transfer stages (few-shot probe, fine-tuning);
- driver: the rest (recording, scheduling).

The sum of everything but training is the per-cell overhead `study.overhead_s_per_cell` stands
for in the plan. Measured figures and the machine's load: docs/study.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def cell_breakdown(study: Path, cell: str) -> dict[str, Any] | None:
    path = study / "state" / f"{cell}.json"
    if not path.exists():
        return None  # not started yet
    record = json.loads(path.read_text())
    stages_path = study / "state" / f"{cell}.stages.json"
    metrics = study / "cells" / (record.get("run_name") or cell) / "metrics" / "rank0.jsonl"
    if record.get("status") != "done" or record.get("runs") != 1 or not stages_path.exists() or not metrics.exists():
        return None  # resumed or unfinished cells mix attempts
    stages = json.loads(stages_path.read_text())
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    pre = stages["pretrain"]
    pre_end = pre["finished_at"]
    pre_start = pre_end - pre["wall_s"]
    first = steps[0]["time"] - steps[0].get("step_time_s", 0.0)
    last = steps[-1]["time"]
    transfer = sum(v["wall_s"] for k, v in stages.items() if k != "pretrain")
    out = {"cell": cell, "wall_s": record["wall_s"], "task_s": pre_start - record["started_at"],
           "train_startup_s": first - pre_start, "training_s": last - first, "teardown_s": pre_end - last,
           "transfer_s": transfer}
    out["driver_s"] = record["wall_s"] - sum(v for k, v in out.items() if k.endswith("_s") and k != "wall_s")
    out["overhead_s"] = record["wall_s"] - out["training_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study_dir")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    study = Path(args.study_dir)
    plan = json.loads((study / "plan.json").read_text())
    rows = [r for r in (cell_breakdown(study, c["id"]) for c in plan["cells"]) if r]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    keys = ["wall_s", "task_s", "train_startup_s", "training_s", "teardown_s", "transfer_s", "driver_s", "overhead_s"]
    print("| cell | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for r in rows:
        print(f"| {r['cell']} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    if rows:
        print("| mean | " + " | ".join(f"{sum(r[k] for r in rows) / len(rows):.1f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
