"""Each cell's compute before anything runs: the paper's accounting, exactly as `vitscale flops`.

Per cell: training FLOPs per example (3 x forward, `scaling/flops.py` through `flops_summary`,
the function behind `vitscale flops`, with the cell's model options, resolution and the dataset's
class count), examples seen (epochs x data size), pre-training exaFLOPs, and an estimated
device-time from the cell's configured throughput (images/s per device). Pure given the sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vitscale.config.checks import ConfigError
from vitscale.scaling.study.cells import Cell


@dataclass(frozen=True)
class DataFacts:
    """What the plan needs to know of the pre-training split."""

    examples: int
    """Samples in the split."""
    num_classes: int
    planned: bool = False
    """True when taken from `study.planned_*` (the dataset is not readable yet)."""


@dataclass(frozen=True)
class PlannedCell:
    id: str
    model: str
    label: str
    family: str
    img_size: int
    num_classes: int
    epochs: float
    examples: int
    """Pre-training samples of the cell (its data size, or the whole split)."""
    examples_seen: int
    """round(epochs x examples), as `vitscale flops` counts them."""
    train_gflops_per_example: float
    exaflops: float
    """Planned pre-training compute (the paper's convention)."""
    device_hours: float | None
    """examples_seen / throughput (images/s per device), in hours; null without a throughput."""
    transfer: tuple[str, ...]

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "transfer": list(self.transfer)}


def plan_cell(cell: Cell, data: DataFacts) -> PlannedCell:
    """One cell's planned compute; a data size beyond the split is refused (naming the cell)."""
    from vitscale.scaling.catalog import flops_summary

    model = dict(cell.raw["model"])
    name, img_size = model.pop("name"), model.pop("img_size")
    options = {k: v for k, v in model.items() if v is not None}
    if cell.data_size is not None and cell.data_size > data.examples:
        raise ConfigError(f"{cell.key}", f"data size {cell.data_size} is larger than the pre-training split "
                                         f"({data.examples} samples)")
    examples = cell.data_size or data.examples
    summary = flops_summary(name, resolution=img_size, examples=examples, epochs=cell.epochs,
                            num_classes=data.num_classes, **options)
    seen = summary["examples_seen"]
    hours = seen / cell.throughput / 3600 if cell.throughput else None
    return PlannedCell(cell.id, summary["model"], cell.label, cell.family, img_size, data.num_classes, cell.epochs,
                       examples, seen, summary["train_gflops_per_example"], summary["train_exaflops"], hours,
                       tuple(cell.raw["stages"][1:]))


def plan_study(cells: list[Cell], data: DataFacts, max_exaflops: float | None) -> list[PlannedCell]:
    """Every cell's plan; refused in one line when the total exceeds `max_exaflops`."""
    planned = [plan_cell(cell, data) for cell in cells]
    total = sum(p.exaflops for p in planned)
    if max_exaflops is not None and total > max_exaflops:
        biggest = max(planned, key=lambda p: p.exaflops)
        raise ConfigError("study.max_exaflops", f"the study plans {total:.4g} exaFLOPs over {len(planned)} cells, "
                                                f"above its budget of {max_exaflops:g} (largest cell: {biggest.id}, "
                                                f"{biggest.exaflops:.4g})")
    return planned


def plan_markdown(planned: list[PlannedCell], data: DataFacts) -> str:
    """The plan as a table, with the study's total."""
    from vitscale.eval.tables import markdown_table

    rows = [{"cell": p.id, "model": p.label, "epochs": f"{p.epochs:g}", "examples": f"{p.examples:,}",
             "img_size": p.img_size, "GFLOPs/example (train)": f"{p.train_gflops_per_example:,.2f}",
             "exaFLOPs": f"{p.exaflops:,.4g}",
             "device-hours (est.)": "" if p.device_hours is None else f"{p.device_hours:,.3g}",
             "transfer": ", ".join(p.transfer)} for p in planned]
    total = sum(p.exaflops for p in planned)
    hours = [p.device_hours for p in planned]
    text = markdown_table(rows, list(rows[0]) if rows else ["cell"])
    where = " (planned size: the dataset is not readable yet)" if data.planned else ""
    text += (f"\n{len(planned)} cells, {total:,.4g} exaFLOPs of pre-training"
             + (f", {sum(hours):,.3g} device-hours (est.)" if hours and None not in hours else "")
             + f"; split of {data.examples:,} samples, {data.num_classes:,} classes{where}\n")
    return text
