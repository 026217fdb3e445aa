"""The study's results from its stored state, at any time (partial rows marked while it runs).

    STUDY_DIR/results.{parquet,csv,md}   Table 6's shape: one row per cell
    STUDY_DIR/fits.{parquet,csv,md}      the power-law fit per family, or why there is none
    STUDY_DIR/compute_vs_accuracy.png    Figure 5: accuracy vs pre-training exaFLOPs, frontier, fits
    STUDY_DIR/data_size_vs_accuracy.png  Sec. 4.3 / Figure 3-4: accuracy vs data size (with subsets)

Everything here reads `plan.json` and `state/*.json` only, so `vitscale study report` regenerates
the same files from a study directory on any machine, while the study runs or after it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitscale.config.location import is_url
from vitscale.scaling.study.fit import FitRefused, PowerLawFit, fit_power_law, pareto_frontier, recommend
from vitscale.scaling.study.state import CellRecord, StudyState

FAMILY_NAMES = {"vit": "ViT", "resnet": "ResNet", "hybrid": "Hybrid"}


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


def cell_rows(plan: dict[str, Any], records: dict[str, CellRecord]) -> list[dict[str, Any]]:
    """Table 6's rows: model, epochs, data size, accuracy per dataset and protocol, compute (pure)."""
    rows = []
    for cell in plan["cells"]:
        record = records.get(cell["id"]) or CellRecord(cell["id"])
        row = {"cell": cell["id"], "model": cell["label"], "family": FAMILY_NAMES.get(cell["family"], cell["family"]),
               "epochs": cell["epochs"], "data_size": cell["examples"], "status": record.status,
               "partial": record.status != "done"}
        row.update(record.accuracies)
        row.update(exaflops=record.exaflops, planned_exaflops=cell["exaflops"], examples_seen=record.examples_seen,
                   device_hours=record.device_hours if record.status == "done" else None,
                   wall_s=round(record.wall_s, 1), runs=record.runs, error=record.error)
        rows.append(row)
    return rows


def accuracy_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The "DATASET PROTOCOL" columns, in first-seen order."""
    skip = {"cell", "model", "family", "epochs", "data_size", "status", "partial", "exaflops", "planned_exaflops",
            "examples_seen", "device_hours", "wall_s", "runs", "error"}
    return list(dict.fromkeys(k for r in rows for k in r if k not in skip))


def family_fits(rows: list[dict[str, Any]], metric: str) -> tuple[dict[str, PowerLawFit], dict[str, str]]:
    """Per family, the fit of error (1 - metric) against measured compute over its finished cells."""
    fits, refused = {}, {}
    for family in dict.fromkeys(r["family"] for r in rows):
        points = [(r["exaflops"], 1.0 - r[metric]) for r in rows
                  if r["family"] == family and not r["partial"] and isinstance(r.get(metric), float)
                  and isinstance(r.get("exaflops"), (int, float)) and r["exaflops"] > 0]
        try:
            fits[family] = fit_power_law([p[0] for p in points], [p[1] for p in points])
        except FitRefused as exc:
            refused[family] = f"{len(points)} finished cell(s): {exc}"
    return fits, refused


def build_report(state: StudyState, out: Path, fit_metric: str | None = None) -> StudyReport:
    """Tables, fits and plots from the study directory's state, written under `out`."""
    from vitscale.eval.tables import write_table
    from vitscale.scaling.study.plots import plot_compute, plot_data_size

    plan = state.plan()
    records = {c["id"]: state.record(c["id"]) for c in plan["cells"]}
    rows = cell_rows(plan, records)
    columns = accuracy_columns(rows)
    metric = fit_metric or plan.get("fit_metric") or (columns[0] if columns else None)
    fits: dict[str, PowerLawFit] = {}
    refused: dict[str, str] = {}
    if metric is not None:
        fits, refused = family_fits(rows, metric)
    files = [str(p) for p in write_table(rows, out, "results")]
    fit_rows = [{"family": f, "metric": metric, **fit.row(), "refused": None} for f, fit in fits.items()]
    fit_rows += [{"family": f, "metric": metric, "refused": why} for f, why in refused.items()]
    files += [str(p) for p in write_table(fit_rows, out, "fits")]
    if metric is not None:
        files.append(str(plot_compute(rows, metric, fits, pareto_frontier, out / "compute_vs_accuracy.png")))
        if len({r["data_size"] for r in rows}) > 1:
            files.append(str(plot_data_size(rows, metric, out / "data_size_vs_accuracy.png")))
    return StudyReport(rows, metric, fits, refused, files)


def publish_report(state: StudyState, fit_metric: str | None = None) -> StudyReport:
    """`build_report` into the study directory itself (a local folder, or uploaded to s3://)."""
    if not is_url(state.url):
        return build_report(state, Path(state.url), fit_metric)
    with tempfile.TemporaryDirectory() as tmp:
        report = build_report(state, Path(tmp), fit_metric)
        for path in Path(tmp).iterdir():
            state.storage.write_file(path.name, path)
        files = [f"{state.url.rstrip('/')}/{Path(p).name}" for p in report.files]
    return StudyReport(report.rows, report.metric, report.fits, report.refused, files)


def recommendation_text(report: StudyReport, budget: float) -> str:
    """`vitscale study recommend`: the family and size to pick for `budget` exaFLOPs, and why."""
    if report.metric is None:
        raise ValueError("no cell has a transfer accuracy yet")
    lines = [f"budget {budget:g} exaFLOPs; accuracy = {report.metric} (fit over finished cells)"]
    cells = [{**r, "accuracy": r.get(report.metric)} for r in report.rows if not r["partial"]]
    ranked = recommend(budget, report.fits, cells)
    for i, rec in enumerate(ranked):
        fit = report.fits[rec.family]
        where = (f"extrapolated past its largest cell ({fit.max_compute:.3g} exaFLOPs)" if rec.extrapolated
                 else "within its measured range")
        best = rec.best_cell
        size = (f"; best measured cell within budget: {best['model']}, {best['epochs']:g} epochs, "
                f"{best['data_size']:,} examples ({best['accuracy']:.4f} at {best['exaflops']:.3g} exaFLOPs)"
                if best else "; no measured cell within this budget")
        lines.append(f"{'-> ' if i == 0 else '   '}{rec.family}: predicted {rec.predicted_accuracy:.4f} "
                     f"({where}){size}")
    for family, why in report.refused.items():
        lines.append(f"   {family}: no fit ({why})")
    if not ranked:
        raise ValueError("no family has a fit: " + "; ".join(f"{f}: {w}" for f, w in report.refused.items()))
    return "\n".join(lines)
