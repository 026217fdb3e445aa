"""The study's results from its stored state, at any time (partial rows marked while it runs).

    STUDY_DIR/results.{parquet,csv,md}   Table 6's shape: one row per cell, planned next to measured
    STUDY_DIR/fits.{parquet,csv,md}      the power-law fit per family with 95% bootstrap intervals and
                                         identifiability warnings, or why there is none
    STUDY_DIR/backtest.{parquet,csv,md}  per family: refit without the largest-compute cell(s), the
                                         prediction error on them
    STUDY_DIR/frontier.{parquet,csv,md}  the Pareto frontier: cells no cheaper cell beats
    STUDY_DIR/compute_vs_accuracy.png    Figure 5: accuracy vs pre-training exaFLOPs, frontier, fits
    STUDY_DIR/data_size_vs_accuracy.png  Sec. 4.3 / Figure 3-4: accuracy vs data size (with subsets)

Everything here reads `plan.json` and `state/*.json` only, so `vitscale study report` regenerates
the same files from a study directory on any machine, while the study runs or after it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitscale.config.errors import UserError
from vitscale.scaling.study.fit import (
    FitRefused,
    PowerLawFit,
    pareto_frontier,
)
from vitscale.scaling.study.recommend import answer_text, recommend
from vitscale.scaling.study.state import CellRecord, StudyState
from vitscale.scaling.study.uncertainty import BOOTSTRAP, BacktestRow, backtest, fit_with_intervals

FAMILY_NAMES = {"vit": "ViT", "resnet": "ResNet", "hybrid": "Hybrid"}
OBJECTIVE_NAMES = {"masked_patch": "masked patch"}
"""A family's name in the report, per pre-training objective other than the labels: ViTs pre-trained by masked
patch prediction follow a curve of their own, never fitted with the supervised ones."""
NOT_ACCURACY = {"cell", "model", "family", "epochs", "data_size", "status", "partial", "exaflops", "planned_exaflops",
                "examples_seen", "planned_device_hours", "device_hours", "pretrain_device_hours", "devices",
                "planned_wall_min", "wall_min", "cost_source", "wall_s", "runs", "error"}


@dataclass(frozen=True)
class StudyReport:
    rows: list[dict[str, Any]]
    """One per cell, in plan order."""
    metric: str | None
    """The accuracy column fits and plots use."""
    fits: dict[str, PowerLawFit]
    """Family -> fit, for the families that have one."""
    refused: dict[str, str]
    """Family -> why it has no fit."""
    files: list[str]
    backtests: dict[str, list[BacktestRow] | str] = field(default_factory=dict)
    """Family -> its backtest rows, or why it has none."""
    frontier: list[dict[str, Any]] = field(default_factory=list)


def cell_rows(plan: dict[str, Any], records: dict[str, CellRecord]) -> list[dict[str, Any]]:
    """Table 6's rows: model, epochs, data size, accuracy per dataset and protocol, compute, and
    planned next to measured device-hours and wall time (pure)."""
    rows = []
    for cell in plan["cells"]:
        record = records.get(cell["id"]) or CellRecord(cell["id"])
        row = {"cell": cell["id"], "model": cell["label"], "family": family_name(cell),
               "epochs": cell["epochs"], "data_size": cell["examples"], "status": record.status,
               "partial": record.status != "done"}
        row.update(record.accuracies)
        planned_wall = cell.get("wall_hours")
        row.update(exaflops=record.exaflops, planned_exaflops=cell["exaflops"], examples_seen=record.examples_seen,
                   planned_device_hours=cell.get("device_hours"),
                   pretrain_device_hours=(record.pretrain_wall_s / 3600 * record.devices
                                          if record.status == "done" and record.devices else None),
                   device_hours=record.total_device_hours() if record.devices else
                   (record.device_hours if record.status == "done" else None),
                   devices=record.devices or cell.get("devices"),
                   planned_wall_min=None if planned_wall is None else round(planned_wall * 60, 2),
                   wall_min=round(record.total_wall_s() / 60, 2), cost_source=cell.get("cost_source"),
                   runs=record.runs, error=record.error)
        rows.append(row)
    return rows


def family_name(cell: dict[str, Any]) -> str:
    """The family a planned cell is reported, plotted and fitted in: its architecture's, and its objective's
    unless supervised (a plan written before cells recorded their objective: supervised)."""
    family = FAMILY_NAMES.get(cell["family"], cell["family"])
    objective = OBJECTIVE_NAMES.get(str(cell.get("objective", "supervised")))
    return f"{family} ({objective})" if objective else family


def accuracy_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The "DATASET PROTOCOL" columns, in first-seen order."""
    return list(dict.fromkeys(k for r in rows for k in r if k not in NOT_ACCURACY))


def _points(rows: list[dict[str, Any]], metric: str, family: str) -> list[tuple[float, float]]:
    """(exaFLOPs, accuracy) of the family's finished cells that have the metric."""
    return [(float(r["exaflops"]), float(r[metric])) for r in rows
            if r["family"] == family and not r["partial"] and isinstance(r.get(metric), float)
            and isinstance(r.get("exaflops"), (int, float)) and r["exaflops"] > 0]


def family_fits(rows: list[dict[str, Any]], metric: str, bootstrap: int = BOOTSTRAP
                ) -> tuple[dict[str, PowerLawFit], dict[str, str]]:
    """Per family, the fit of error (1 - metric) against measured compute over its finished cells."""
    fits, refused = {}, {}
    for family in dict.fromkeys(r["family"] for r in rows):
        points = _points(rows, metric, family)
        try:
            fits[family] = fit_with_intervals([p[0] for p in points], [1.0 - p[1] for p in points], bootstrap=bootstrap)
        except FitRefused as exc:
            refused[family] = f"{len(points)} finished cell(s): {exc}"
    return fits, refused


def family_backtests(rows: list[dict[str, Any]], metric: str, bootstrap: int = BOOTSTRAP
                     ) -> dict[str, list[BacktestRow] | str]:
    """Per family, the backtest without its largest-compute cell(s), or why there is none."""
    out: dict[str, list[BacktestRow] | str] = {}
    for family in dict.fromkeys(r["family"] for r in rows):
        points = _points(rows, metric, family)
        try:
            out[family] = backtest([p[0] for p in points], [p[1] for p in points], bootstrap=bootstrap)
        except FitRefused as exc:
            out[family] = str(exc)
    return out


def frontier_rows(rows: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The finished cells on the Pareto frontier of (exaFLOPs, metric), cheapest first."""
    done = [r for r in rows if not r["partial"] and isinstance(r.get(metric), float)
            and isinstance(r.get("exaflops"), (int, float))]
    front = set(pareto_frontier([(float(r["exaflops"]), float(r[metric])) for r in done]))
    picked, seen = [], set()
    for r in sorted(done, key=lambda r: (r["exaflops"], -r[metric])):
        point = (float(r["exaflops"]), float(r[metric]))
        if point in front and point not in seen:
            seen.add(point)
            picked.append({"cell": r["cell"], "model": r["model"], "family": r["family"], "epochs": r["epochs"],
                           "data_size": r["data_size"], "exaflops": r["exaflops"], metric: r[metric]})
    return picked


def build_report(state: StudyState, out: Path, fit_metric: str | None = None, bootstrap: int = BOOTSTRAP
                 ) -> StudyReport:
    """Tables, fits and plots from the study directory's state, written under `out`."""
    from vitscale.eval.tables import write_table
    from vitscale.scaling.study.plots import plot_compute, plot_data_size

    plan = state.plan()
    records = {c["id"]: state.record(c["id"]) for c in plan["cells"]}
    rows = cell_rows(plan, records)
    columns = accuracy_columns(rows)
    metric = fit_metric or plan.get("fit_metric") or (columns[0] if columns else None)
    # Every finished cell reports every column: a metric none has, once some have finished, is a typo that
    # would leave every fit refused ("0 finished cells") rather than an answer still to come.
    if metric is not None and columns and metric not in columns:
        raise UserError(f"no accuracy column {metric!r} in the study's results (--metric, or study.fit_metric); "
                        f"they have: {', '.join(columns)}")
    fits: dict[str, PowerLawFit] = {}
    refused: dict[str, str] = {}
    backtests: dict[str, list[BacktestRow] | str] = {}
    frontier: list[dict[str, Any]] = []
    if metric is not None:
        fits, refused = family_fits(rows, metric, bootstrap)
        backtests = family_backtests(rows, metric, bootstrap)
        frontier = frontier_rows(rows, metric)
    files = [str(p) for p in write_table(rows, out, "results")]
    fit_rows = [{"family": f, "metric": metric, **fit.row(), "refused": None} for f, fit in fits.items()]
    fit_rows += [{"family": f, "metric": metric, "refused": why} for f, why in refused.items()]
    files += [str(p) for p in write_table(fit_rows, out, "fits")]
    test_rows: list[dict[str, Any]] = []
    for family, result in backtests.items():
        if isinstance(result, str):
            test_rows.append({"family": family, "refused": result})
        else:
            test_rows += [{"family": family, **r.row(), "refused": None} for r in result]
    files += [str(p) for p in write_table(test_rows or [{"family": None}], out, "backtest")]
    files += [str(p) for p in write_table(frontier or [{"cell": None}], out, "frontier")]
    if metric is not None:
        files.append(str(plot_compute(rows, metric, fits, pareto_frontier, out / "compute_vs_accuracy.png")))
        if len({r["data_size"] for r in rows}) > 1:
            files.append(str(plot_data_size(rows, metric, out / "data_size_vs_accuracy.png")))
    return StudyReport(rows, metric, fits, refused, files, backtests, frontier)


def publish_report(state: StudyState, fit_metric: str | None = None, bootstrap: int = BOOTSTRAP) -> StudyReport:
    """`build_report` into the study directory itself (a local folder, or uploaded to s3://)."""
    if "://" not in state.url:
        return build_report(state, Path(state.url), fit_metric, bootstrap)
    with tempfile.TemporaryDirectory() as tmp:
        report = build_report(state, Path(tmp), fit_metric, bootstrap)
        for path in Path(tmp).iterdir():
            state.storage.write_file(path.name, path)
        files = [f"{state.url.rstrip('/')}/{Path(p).name}" for p in report.files]
    return StudyReport(report.rows, report.metric, report.fits, report.refused, files, report.backtests,
                       report.frontier)


def recommendation_text(report: StudyReport, budget: float) -> str:
    """`vitscale study recommend`: the family and cell to pick for `budget` exaFLOPs, and why."""
    if report.metric is None:
        raise ValueError("no cell has a transfer accuracy yet")
    cells = [{**r, "accuracy": r.get(report.metric)} for r in report.rows if not r["partial"]]
    answers = recommend(budget, report.fits, cells, report.refused)
    if not answers:
        raise ValueError("no finished cell and no fit yet")
    return answer_text(answers, budget, report.metric, report.fits)


def backtest_lines(report: StudyReport) -> list[str]:
    """One line per family: the held-out cells' prediction errors, or why there is no backtest."""
    out = []
    for family, result in report.backtests.items():
        if isinstance(result, str):
            out.append(f"backtest {family}: none ({result})")
            continue
        for r in result:
            inside = {True: "inside", False: "OUTSIDE", None: "no"}[r.covered]
            band = f" [{r.lo:.4f}, {r.hi:.4f}]" if r.lo is not None and r.hi is not None else ""
            out.append(f"backtest {family}: held out {r.compute:.3g} exaFLOPs: predicted {r.predicted:.4f}{band}, "
                       f"measured {r.measured:.4f}, error {r.error:+.4f} ({inside} interval)")
    return out


def fit_line(fit: PowerLawFit) -> str:
    """A fit in one line: the law, each parameter's 95% bootstrap interval, the cells and range."""
    law = f"E = {fit.a:.4g} (C + {fit.d:.3g})^-{fit.b:.4g} + {fit.c:.4f}"
    if fit.intervals:
        spans = ", ".join(f"{n} [{lo:.3g}, {hi:.3g}]" for n, (lo, hi) in zip("abcd", fit.intervals))
        law += f"   95% bootstrap: {spans}"
    else:
        law += f"   [b ± {fit.b_std:.2g}, c ± {fit.c_std:.2g} (linearised)]"
    return law + f"; {fit.points} cells, {fit.min_compute:.3g}-{fit.max_compute:.3g} exaFLOPs"
