"""What a sweep leaves behind: one row per trial, the selection, the winner's test accuracy."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitscale.config.location import is_url
from vitscale.eval.tables import save_figure


@dataclass(frozen=True)
class SweepResult:
    """Every trial as a row, the selected settings, and the winner's one test accuracy."""

    directory: str
    trials: tuple[dict[str, Any], ...]
    selected: dict[str, Any]
    final: dict[str, Any]
    scratch: dict[str, Any] | None = None
    """The same sweep from random weights (`sweep.scratch_baseline`): its selection and test accuracy."""

    def summary(self) -> dict[str, Any]:
        out = {"directory": self.directory, "trials": len(self.trials), "selected": self.selected, **self.final}
        if self.scratch is not None:
            out["scratch"] = self.scratch
        return out

    def headline(self) -> dict[str, Any]:
        """Top-level keys of the final JSON line: the transfer result at a glance."""
        lr = self.selected.get("params", {}).get("finetune.train.base_lr")
        out: dict[str, Any] = {"sweep_dir": self.directory}
        if "test_accuracy" in self.final:
            out["finetune"] = {"pretrained": {"test_accuracy": self.final["test_accuracy"], "best_lr": lr}}
            if self.scratch is not None and "test_accuracy" in self.scratch:
                out["finetune"]["scratch"] = {
                    "test_accuracy": self.scratch["test_accuracy"],
                    "best_lr": self.scratch["selected"].get("params", {}).get("finetune.train.base_lr")}
        return out

    def rows(self) -> list[tuple[str, str]]:
        out = []
        for row in self.trials:
            params = "  ".join(f"{k.split('.')[-1]} {v:g}" if isinstance(v, float) else f"{k.split('.')[-1]} {v}"
                               for k, v in row["params"].items())
            score = row.get("metric")
            text = f"{row['status']:<9} " + (f"{score:.4f}" if isinstance(score, float) else "-")
            out.append((f"trial {row['trial_id']}", f"{params}   {text}"))
        if self.selected:
            out.append(("selected", json.dumps(self.selected["params"]) + f"  (dev {self.selected['metric']:.4f})"))
        if "test_accuracy" in self.final:
            out.append(("test accuracy", f"{self.final['test_accuracy']:.4f}  (winner retrained, tested once)"))
        if self.scratch is not None and "test_accuracy" in self.scratch:
            params = json.dumps(self.scratch["selected"]["params"])
            out.append(("from scratch",
                        f"{self.scratch['test_accuracy']:.4f}  (same sweep from random weights, {params})"))
        out.append(("results", f"{self.directory}/results.md"))
        return out



def trial_id_of(result: Any) -> str:
    """A Tune result's trial id: the one its reports carry, else its folder's name."""
    return str((result.metrics or {}).get("trial_id") or Path(str(result.path)).name)


def trial_row(result: Any, space: dict[str, Any], metric: str, pre_exaflops: float | None) -> dict[str, Any]:
    """One trial as a table row; a failed trial keeps its error and the sweep goes on."""
    metrics = dict(result.metrics or {})
    config = dict(result.config or {})
    history = getattr(result, "metrics_dataframe", None)
    best = None
    if history is not None and metric in getattr(history, "columns", ()):
        values = history[metric].dropna()
        best = float(values.iloc[-1]) if len(values) else None
    trial_id = trial_id_of(result)
    status = "error" if result.error else ("finished" if "finished_at" in metrics else "stopped")
    started, ended = metrics.get("started_at"), metrics.get("finished_at")
    # Tune's time_total_s restarts with a restarted trial (one that finished before a driver died
    # and is reported again takes ~0 s); the trial's own start and finish times do not. Attempts that
    # died before the one that finished (a killed driver, a failed worker) add their own time.
    wall = ended - started if started is not None and ended is not None else metrics.get("time_total_s")
    if wall is not None and started is not None:
        wall += earlier_attempts_s(_reports(result), started)
    return {
        "trial_id": trial_id, "params": {k: config.get(k) for k in space}, "metric": best,
        "steps": metrics.get("step"), "wall_time_s": wall,
        "started_at": metrics.get("started_at"), "finished_at": metrics.get("finished_at"), "status": status,
        "pretrain_exaflops": pre_exaflops, "finetune_exaflops": metrics.get("cumulative_exaflops"),
        "error": error_text(result.error) if result.error else None,
    }


def earlier_attempts_s(reports: list[dict[str, Any]], started_at: float) -> float:
    """Seconds spent by a trial's attempts that ended before its last attempt began at `started_at` (pure).

    `reports` are Tune's records of the trial in the order written (result.json): an attempt's
    `time_total_s` grows from its start, so a drop starts the next attempt, and an attempt's time is its
    last record's. Only attempts whose last record (`timestamp`, Unix seconds) is before `started_at`
    count: the last attempt, and one whose final report was merely replayed, are in `started_at`'s span.
    """
    total, last = 0.0, None
    for report in [*reports, None]:
        elapsed = None if report is None else report.get("time_total_s")
        if report is not None and not isinstance(elapsed, (int, float)):
            continue
        ended = last is not None and (report is None or elapsed < last["time_total_s"])  # `last`'s attempt ended
        if ended and last is not None and float(last.get("timestamp") or float("inf")) <= started_at:
            total += float(last["time_total_s"])
        if report is not None:
            last = report
    return total


def _reports(result: Any) -> list[dict[str, Any]]:
    """The trial's records from its result.json in the experiment (local experiments; [] otherwise)."""
    path = Path(str(getattr(result, "path", "") or "")) / "result.json"
    if is_url(str(getattr(result, "path", ""))) or not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return out


def error_text(error: BaseException) -> str:
    """A failed trial's cause in one line: the workers' own errors, not Ray's wrappers around them.

    Tune hands back a `RayTaskError` whose first line is the trial actor's name and pid (with ANSI
    colours); Ray Train's `WorkerGroupError` inside it keeps each rank's exception.
    """
    import re

    cause = getattr(error, "cause", None) or error
    if getattr(cause, "worker_failures", None):
        from vitscale.launch.ray_train import _root_cause

        return _root_cause(cause)[:300]
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines() if line.strip()]
    return (lines[-1] if lines else type(cause).__name__)[:300]


def flat_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"trial_id": row["trial_id"], **row["params"], **{k: v for k, v in row.items()
                                                              if k not in ("trial_id", "params")}}


FINAL_REPORT = "final_report.json"
"""A trial's final report to Tune (its last step's metrics, dev accuracy, start and finish times), which the
trial writes whole into its own folder (`sweep/trials/<id>/`) before it reports it."""


def save_final_report(trial_storage: str, report: dict[str, Any]) -> None:
    """Keep `report` in the trial's folder `trial_storage` (a folder or an s3:// prefix), whole or not at all."""
    from vitscale.data.storage import open_storage

    open_storage(trial_storage).write_bytes(FINAL_REPORT, json.dumps(report).encode())


def finished_trials(trials_storage: str) -> dict[str, dict[str, Any]]:
    """Trial id -> its final report, for every trial under `trials_storage` (`sweep/trials`) that saved one.

    Tune copies its trials' states and results to the experiment's storage every >= 10 s: a driver killed
    in between leaves a trial that had ended on record as running, and `Tuner.restore(resume_unfinished=True)`
    would train it again, with new start and finish times. Its own report, saved as it ended, says it ended.
    A report that does not read as one (a stray file) is not taken: that trial is trained again.
    """
    from vitscale.data.storage import open_storage

    store = open_storage(trials_storage)
    out: dict[str, dict[str, Any]] = {}
    for name in store.list():
        trial_id, _, file = name.rpartition("/")
        if file != FINAL_REPORT or not trial_id or "/" in trial_id:
            continue
        try:
            report = json.loads(store.read_bytes(name))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(report, dict) and "finished_at" in report:
            out[trial_id] = report
    return out


def search_points(rows: Sequence[dict[str, Any]], x: str) -> list[tuple[float, float]]:
    """(value of `x`, dev metric) of every scored trial of one search, sorted by `x` (pure)."""
    return sorted((float(r["params"][x]), float(r["metric"])) for r in rows
                  if isinstance(r.get("metric"), float) and isinstance(r.get("params", {}).get(x), (int, float)))


def plot_searches(path: Path, x: str, metric: str,
                  searches: Sequence[tuple[str, Sequence[dict[str, Any]], dict[str, Any], dict[str, Any]]]) -> Path:
    """One PNG of every search on one axis: each search's dev `metric` against `x` (log scale for a learning
    rate), its chosen value starred, and the winner's test accuracy (tested once) drawn beside it.

    `searches`: (label, trial rows, the selection, the retrained winner's results) per search, e.g. the
    pre-trained search and the same search from random weights.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    every_x: list[float] = []
    for label, rows, selected, final in searches:
        points = search_points(rows, x)
        every_x += [p[0] for p in points]
        (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=f"{label}: dev {metric}")
        chosen, dev = selected.get("params", {}).get(x), selected.get("metric")
        if isinstance(chosen, (int, float)) and isinstance(dev, float):
            ax.plot([chosen], [dev], "*", markersize=16, color=line.get_color(),
                    label=f"{label}: chosen {x.rsplit('.', 1)[-1]} {chosen:g}")
            test = final.get("test_accuracy")
            if isinstance(test, float):
                ax.plot([chosen], [test], "D", markersize=8, markerfacecolor="none", color=line.get_color(),
                        label=f"{label}: test accuracy {test:.4f} (retrained, tested once)")
    if x.endswith("lr") and every_x and min(every_x) > 0:
        ax.set_xscale("log")
    if every_x:  # ticks at the values tried, as they were written
        ax.set_xticks(sorted(set(every_x)), [f"{v:g}" for v in sorted(set(every_x))])
        ax.minorticks_off()
    ax.set_xlabel(x)
    ax.set_ylabel("accuracy")
    ax.set_title(f"{metric} per trial" + (" and the winners' test accuracy" if len(searches) else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)  # below: never over a point
    save_figure(fig, path, bbox_inches="tight")
    plt.close(fig)
    return path


def pretrain_exaflops(pretrained: Sequence[Any], checkpoint: str | None) -> float | None:
    """Pre-training compute behind a fine-tuning sweep, in exaFLOPs: the pretrain stages' of this pipeline,
    else what the run or checkpoint the sweep starts from recorded (`finetune.checkpoint`); None where
    nothing says (a weights file from elsewhere)."""
    if pretrained:
        return sum(float(r.metrics.get("cumulative_exaflops") or 0) for r in pretrained)
    if checkpoint is None or not str(checkpoint):
        return None
    from vitscale.train import checkpoint as ckpt
    from vitscale.train.export import find_checkpoint

    try:
        found = find_checkpoint(checkpoint)
    except (OSError, ValueError):  # a file (an export, .npz, timm): no training state to read
        return None
    return float(ckpt.read_train_state(found).flops) / 1e18
