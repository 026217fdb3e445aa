"""How much of the full grid's training does ASHA spend to find the grid's best learning rate?

    python benchmarks/sweep_efficiency.py [--init pretrained|scratch] [--steps 400] [--lrs 0.001 ... 1.0]
        [--grace N] [--reduction-factor K] [--work DIR [--reuse]] [--json]

The same search space runs twice through the real sweep stage (`vitscale run`, a local Ray, one
Ray Train worker per trial): first `sweep.scheduler: grid` (every trial to the end; each also
scored every 1/16 of its steps, so the JSON holds every trial's dev curve), then
`sweep.scheduler: asha` (the stage's defaults unless `--grace` / `--reduction-factor` are given:
grace period an eighth of the steps, reduction factor 3, each trial scored on its dev split at
every rung, where ASHA judges it). The problem: fine-tuning a small ViT (2 layers, width 64,
patch 8 at 32 px) on scikit-learn's handwritten digits (10 classes, 80/20 train/test, 20% of the
training split carved off as the dev set), SGD momentum with the paper's recipe, 10 learning rates
over three decades. `--init pretrained` (the default: what a fine-tuning sweep is for) starts every
trial from that ViT pre-trained on 6,000 FractalDB-style images by the pretrain stage (made once per
work folder); `--init scratch` from random weights.

Counted: trial-steps, the sum over trials of the last optimizer step each trial reached (the
`steps` column of `RUN_DIR/sweep/results.parquet`); evaluations are not counted. Reported: both
totals, ASHA's fraction of the grid's, both best dev accuracies, and whether ASHA's best reached
the grid's best or came within 0.5 points of it. Also the trial-steps ASHA had spent when it
reached it: the moment a trial finished all its steps with a dev accuracy within 0.5 points of the
grid's best, every trial counted up to its first report after that moment (reports are every 1/8
of the steps, so this over-counts rather than under-counts; trials not yet started count 0).
Target: ASHA spends <= 35% of the grid's trial-steps to reach the grid's best (within 0.5 points).

Not part of the test suite; a run takes several minutes on 2 CPU cores (Ray Train's start-up per
trial dominates). The winner is not retrained (`sweep.retrain: false`): selection is what is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

MODEL = {"name": "ViT-Ti/8", "img_size": 32, "depth": 2, "width": 64, "mlp_dim": 128, "heads": 2}
LRS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
TARGET = 0.35
TOLERANCE = 0.005
"""Within 0.5 points of dev accuracy counts as reaching the grid's best."""


def prepare(work: Path, init: str, cpus: int) -> tuple[str, str]:
    """The digits dataset and the weights every trial starts from, made once per work dir: a randomly
    initialised ViT (a vitscale export), or (`pretrained`) the same ViT pre-trained on fractals by
    the pretrain stage (`vitscale run`, one Ray Train worker), as a run directory."""
    import torch

    from vitscale.data.tools.write import write_dataset
    from vitscale.models import create_model, export_state_dict

    data = work / "digits"
    if not (data / "dataset.json").exists():
        write_dataset("digits", str(data), shard_size=500, max_side=32, seed=0, progress=False,
                      splits={"train": 0.8, "test": 0.2}, source_options={"image_size": 32})
    if init == "pretrained":
        return str(data), pretrain(work, cpus)
    weights = work / "random-init.pt"
    if not weights.exists():
        torch.manual_seed(0)
        options = {k: v for k, v in MODEL.items() if k != "name"}
        export_state_dict(create_model(MODEL["name"], num_classes=10, **options), weights)
    return str(data), str(weights)


def pretrain(work: Path, cpus: int) -> str:
    """MODEL pre-trained on 6,000 FractalDB-style images (10 classes, 6 epochs): its run directory."""
    from vitscale.data.tools.write import write_dataset

    fractals, run = work / "fractal10", work / "runs" / "efficiency-pretrain"
    if (run / "summary.json").exists():
        return str(run)
    if not (fractals / "dataset.json").exists():
        write_dataset("fractal", str(fractals), shard_size=1000, max_side=64, seed=0, progress=False,
                      source_options={"count": 6000, "classes": 10, "image_size": 64})
    raw = {
        "name": "efficiency-pretrain", "stages": ["pretrain"], "model": MODEL,
        "data": {"url": str(fractals), "num_workers": 1, "shuffle_buffer": 1000},
        "train": {"global_batch": 128, "micro_batch": 128, "epochs": 6, "base_lr": 1e-3, "warmup_steps": 40,
                  "weight_decay": 0.05, "grad_clip": 1.0, "zero_stage": 0, "precision": "fp32",
                  "checkpoint_every": 1000, "log_every": 50},
        "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "max_failures": 0,
                    "local_num_cpus": cpus, "storage_path": str(work / "runs")},
    }
    path = work / "efficiency-pretrain.yaml"
    path.write_text(yaml.safe_dump(raw))
    print(f"[benchmark] pre-training the trials' start on fractals (log {work / 'efficiency-pretrain.log'})",
          file=sys.stderr, flush=True)
    run_pipeline(path, work / "efficiency-pretrain.log")
    return str(run)


def pipeline(work: Path, name: str, scheduler: str, data: str, weights: str, args: argparse.Namespace) -> Path:
    raw = {
        "name": name,
        "stages": ["sweep"],
        "model": MODEL,
        "finetune": {"checkpoint": weights, "lr_grid": list(args.lrs), "resolution": 32, "dev_fraction": 0.2,
                     "data": {"url": data, "num_workers": 0},
                     "train": {"max_steps": args.steps, "global_batch": args.batch, "micro_batch": args.batch,
                               "precision": "fp32", "log_every": max(1, args.steps // 8),
                               "checkpoint_every": args.steps,
                               # The grid's trials are also scored every 1/16 of their steps: their dev curves
                               # (in the JSON) show where ASHA's rungs would judge them. Training is unchanged.
                               **({"eval_every": max(1, args.steps // 16)} if scheduler == "grid" else {})}},
        "sweep": {"scheduler": scheduler, "workers_per_trial": 1, "retrain": False,
                  **({"grace_period": args.grace} if args.grace and scheduler == "asha" else {}),
                  **({"reduction_factor": args.reduction_factor}
                     if args.reduction_factor and scheduler == "asha" else {})},
        "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "max_failures": 0,
                    "local_num_cpus": args.cpus, "storage_path": str(work / "runs")},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_pipeline(path: Path, log: Path) -> float:
    """`vitscale run PIPELINE` to the end; returns its wall time in seconds."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    vitscale = str(Path(sys.executable).parent / "vitscale")
    t0 = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run([vitscale, "run", str(path)], check=False, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        sys.exit(f"{path.name} failed (exit {done.returncode}); see {log}\n" + log.read_text()[-3000:])
    return time.perf_counter() - t0


def trials(run_dir: Path) -> list[dict[str, Any]]:
    import pandas as pd

    table = pd.read_parquet(run_dir / "sweep" / "results.parquet")
    reports = tune_reports(run_dir)
    return [{"lr": float(r["finetune.train.base_lr"]), "steps": int(r["steps"]) if r["steps"] == r["steps"] else 0,
             "dev_accuracy": None if r["metric"] != r["metric"] else float(r["metric"]), "status": r["status"],
             "dev_curve": {step: acc for _, step, acc in reports.get(float(r["finetune.train.base_lr"]), [])
                           if acc is not None},
             "reports": reports.get(float(r["finetune.train.base_lr"]), [])}
            for r in table.to_dict("records")]


def tune_reports(run_dir: Path) -> dict[float, list[tuple[float, int, float | None]]]:
    """Learning rate -> the trial's reports to Tune as (unix time in s, step, dev accuracy or None).

    The first entry is the trial's start, as step 0 (Tune's time of its first report less the
    trial's running time then).
    """
    out: dict[float, list[tuple[float, int, float | None]]] = {}
    for path in run_dir.glob("sweep-trials/*/result.json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            start = rows[0]["timestamp"] - rows[0]["time_total_s"]
            out[float(rows[0]["config"]["finetune.train.base_lr"])] = [(start, 0, None)] + [
                (r["timestamp"], int(r["step"]), float(r["dev_accuracy"]) if "dev_accuracy" in r else None)
                for r in rows]
    return out


def steps_to_reach(reports: list[list[tuple[float, int, float | None]]], steps: int, target: float) -> int | None:
    """Trial-steps spent when a trial first finished `steps` steps with dev accuracy >= `target` (pure).

    `reports`: per trial, (time, step, dev accuracy or None), starting with (start time, 0, None).
    Each trial counts up to its first report after that moment (its last one if none came after),
    so steps between reports are counted in full; a trial that started later counts 0. None if no
    trial reached `target`.
    """
    moments = [t for trial in reports for t, step, acc in trial if step == steps and acc is not None and acc >= target]
    if not moments:
        return None
    reached = min(moments)
    spent = 0
    for trial in reports:
        after = [step for t, step, _ in trial if t > reached]
        spent += after[0] if after else max((step for _, step, _ in trial), default=0)
    return spent


def summarise(grid: list[dict[str, Any]], asha: list[dict[str, Any]], args: argparse.Namespace,
              seconds: dict[str, float]) -> dict[str, Any]:
    def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return max((r for r in rows if r["dev_accuracy"] is not None), key=lambda r: r["dev_accuracy"])

    grid_steps, asha_steps = sum(r["steps"] for r in grid), sum(r["steps"] for r in asha)
    g, a = best(grid), best(asha)
    fraction = asha_steps / grid_steps
    reached = a["dev_accuracy"] >= g["dev_accuracy"] - TOLERANCE
    to_reach = steps_to_reach([r["reports"] for r in asha], args.steps, g["dev_accuracy"] - TOLERANCE)
    to_reach_fraction = None if to_reach is None else to_reach / grid_steps
    return {
        "init": args.init, "search_space": {"finetune.train.base_lr": list(args.lrs)}, "steps_per_trial": args.steps,
        "batch": args.batch,
        "grace": args.grace, "reduction_factor": args.reduction_factor,
        "grid_trial_steps": grid_steps, "asha_trial_steps": asha_steps, "asha_fraction": fraction,
        "asha_trial_steps_to_reach": to_reach, "asha_fraction_to_reach": to_reach_fraction,
        "grid_best_dev_accuracy": g["dev_accuracy"], "grid_best_lr": g["lr"],
        "asha_best_dev_accuracy": a["dev_accuracy"], "asha_best_lr": a["lr"],
        "asha_reached_grid_best": a["dev_accuracy"] >= g["dev_accuracy"], "asha_within_tolerance": reached,
        "tolerance": TOLERANCE, "target_fraction": TARGET,
        "meets_target": to_reach_fraction is not None and to_reach_fraction <= TARGET,
        "seconds": seconds, "trials": {"grid": grid, "asha": asha},
    }


def print_table(s: dict[str, Any]) -> None:
    lrs = s["search_space"]["finetune.train.base_lr"]
    start = "fine-tuning a fractal-pre-trained ViT" if s["init"] == "pretrained" else "training from random weights"
    print(f"\nASHA vs the full grid, {start}: {len(lrs)} learning rates {min(lrs):g}..{max(lrs):g}, "
          f"{s['steps_per_trial']} steps of batch {s['batch']} per trial\n")
    grid = {r["lr"]: r for r in s["trials"]["grid"]}
    asha = {r["lr"]: r for r in s["trials"]["asha"]}

    def acc(r: dict[str, Any] | None) -> str:
        return "-" if r is None or r["dev_accuracy"] is None else f"{r['dev_accuracy']:.4f}"

    print(f"{'lr':>8}  {'grid steps':>10}  {'grid dev':>8}  {'asha steps':>10}  {'asha dev':>8}  asha status")
    for lr in sorted(set(grid) | set(asha)):
        g, a = grid.get(lr), asha.get(lr)
        print(f"{lr:>8g}  {g['steps'] if g else '-':>10}  {acc(g):>8}  {a['steps'] if a else '-':>10}  "
              f"{acc(a):>8}  {a['status'] if a else '-'}")
    print()
    rows = [
        ("trial-steps", f"{s['grid_trial_steps']}", f"{s['asha_trial_steps']}"),
        ("best dev accuracy", f"{s['grid_best_dev_accuracy']:.4f}", f"{s['asha_best_dev_accuracy']:.4f}"),
        ("best learning rate", f"{s['grid_best_lr']:g}", f"{s['asha_best_lr']:g}"),
        ("wall time (s)", f"{s['seconds']['grid']:.0f}", f"{s['seconds']['asha']:.0f}"),
    ]
    print(f"{'':<20}{'grid':>10}{'asha':>10}")
    for label, g, a in rows:
        print(f"{label:<20}{g:>10}{a:>10}")
    print()
    print(f"ASHA reached the grid's best: {'yes' if s['asha_reached_grid_best'] else 'no'}; "
          f"within {s['tolerance'] * 100:.1f} points: {'yes' if s['asha_within_tolerance'] else 'no'}")
    if s["asha_fraction_to_reach"] is not None:
        print(f"ASHA had spent {s['asha_fraction_to_reach']:.1%} of the grid's trial-steps when it reached it "
              f"(target <= {s['target_fraction']:.0%})")
    print(f"ASHA spent {s['asha_fraction']:.1%} of the grid's trial-steps in all (its later trials included)")
    print(f"target met: {'yes' if s['meets_target'] else 'no'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", choices=("pretrained", "scratch"), default="pretrained",
                        help="trials fine-tune MODEL pre-trained on fractals (the sweep's use), or from random weights")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per trial")
    parser.add_argument("--batch", type=int, default=32, help="global batch (one worker)")
    parser.add_argument("--lrs", type=float, nargs="+", default=LRS, help="the learning-rate grid")
    parser.add_argument("--grace", type=int, default=None, help="ASHA's grace period in steps (default: the stage's)")
    parser.add_argument("--reduction-factor", type=int, default=None,
                        help="ASHA's reduction factor (default: the stage's)")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs of the local Ray")
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse a finished sweep in --work whose pipeline is unchanged (e.g. the grid)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="sweep-efficiency-"))
    work.mkdir(parents=True, exist_ok=True)
    data, weights = prepare(work, args.init, args.cpus)
    seconds, results = {}, {}
    for scheduler in ("grid", "asha"):
        name = f"efficiency-{args.init}-{scheduler}"
        previous = (work / f"{name}.yaml").read_text() if (work / f"{name}.yaml").exists() else None
        path = pipeline(work, name, scheduler, data, weights, args)
        done = work / "runs" / name / "sweep" / "results.parquet"
        if args.reuse and previous == path.read_text() and done.exists():
            seconds[scheduler] = float("nan")  # reused: this run did not time it
            if not args.json:
                print(f"[benchmark] {scheduler}: reusing the finished {name} in {work}", flush=True)
        else:
            for old in (work / "runs").glob(f"{name}*"):  # a fresh sweep, not a resumed one
                shutil.rmtree(old)
            if not args.json:
                print(f"[benchmark] {scheduler}: running {name} (log {work / f'{name}.log'})", flush=True)
            seconds[scheduler] = run_pipeline(path, work / f"{name}.log")
        results[scheduler] = trials(work / "runs" / name)
    summary = summarise(results["grid"], results["asha"], args, seconds)
    summary["work"] = str(work)
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)


if __name__ == "__main__":
    main()
