"""Each cell's compute before anything runs: the paper's accounting, exactly as `vitscale flops`,
and what it costs (`costs.py`).

Per cell: training FLOPs per example (3 x forward, `scaling/flops.py` through `flops_summary`,
the function behind `vitscale flops`, with the cell's model options, resolution and the dataset's
class count), examples seen (epochs x data size), pre-training exaFLOPs, then device-hours from
those FLOPs at the device's peak and an MFU (measured, or a labelled estimate), devices, wall
time and cost. Pure given the sizes and the pricing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vitscale.config.checks import ConfigError
from vitscale.scaling.study.cells import Cell
from vitscale.scaling.study.costs import (
    MeasuredMFU,
    cell_cost,
    choose_mfu,
    study_wall_hours,
)


@dataclass(frozen=True)
class DataFacts:
    """What the plan needs to know of the pre-training split."""

    examples: int
    """Samples in the split."""
    num_classes: int
    planned: bool = False
    """True when taken from `study.planned_*` (the dataset is not readable yet)."""


@dataclass(frozen=True)
class Pricing:
    """How the plan turns FLOPs into time and money (from the study and cluster sections)."""

    device: str = "H100"
    """A `costs.PEAK_FLOPS` name."""
    devices_per_cell: float = 1.0
    """Devices one cell's run holds (GPUs, or CPU cores of its workers)."""
    overhead_s: float = 0.0
    """Seconds per cell FLOPs do not count."""
    price: float | None = None
    """Per device-hour."""
    concurrency: int = 1
    """Cells at once, for the study's wall time."""
    mfu_table: list[MeasuredMFU] = field(default_factory=list)
    mfu_source: str = "benchmarks/RESULTS.md"


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
    """Pre-training device-hours: exaFLOPs / (peak x MFU), or examples seen / measured throughput."""
    transfer: tuple[str, ...]
    devices: float = 1.0
    wall_hours: float | None = None
    """The cell's wall time: device time over its devices plus the per-cell overhead."""
    cost: float | None = None
    mfu: float | None = None
    cost_source: str = ""
    """Where the speed came from (a measurement, or an estimate and its default)."""
    device: str = ""
    objective: str = "supervised"
    """How the cell pre-trains (`train.objective`): a report fits each family and objective on its own."""

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "transfer": list(self.transfer)}


def plan_cell(cell: Cell, data: DataFacts, pricing: Pricing | None = None) -> PlannedCell:
    """One cell's planned compute and cost; a data size beyond the split is refused (naming the cell)."""
    from vitscale.scaling.catalog import flops_summary

    pricing = pricing or Pricing()
    model = dict(cell.raw["model"])
    name, img_size = model.pop("name"), model.pop("img_size")
    options = {k: v for k, v in model.items() if v is not None}
    if cell.data_size is not None and cell.data_size > data.examples:
        raise ConfigError(f"{cell.key}", f"data size {cell.data_size} is larger than the pre-training split "
                                         f"({data.examples} samples)")
    examples = cell.data_size or data.examples
    try:
        summary = flops_summary(name, resolution=img_size, examples=examples, epochs=cell.epochs,
                                num_classes=data.num_classes, masked_patch=_masked_patch(cell), **options)
    except ConfigError as exc:  # e.g. more epochs than a float counts the FLOPs of: name the cell
        raise ConfigError(cell.key, f"{exc.key}: {exc.message}") from None
    seen = summary["examples_seen"]
    mfu, source = choose_mfu(summary["model"], cell.family, pricing.device, pricing.mfu_table, pricing.mfu_source)
    cost = cell_cost(exaflops=summary["train_exaflops"], examples_seen=seen, devices=pricing.devices_per_cell,
                     device=pricing.device, mfu=mfu, mfu_source=source, throughput=cell.throughput,
                     overhead_s=pricing.overhead_s, price=pricing.price)
    return PlannedCell(cell.id, summary["model"], cell.label, cell.family, img_size, data.num_classes, cell.epochs,
                       examples, seen, summary["train_gflops_per_example"], summary["train_exaflops"],
                       cost.device_hours, tuple(cell.raw["stages"][1:]), cost.devices, cost.wall_hours, cost.cost,
                       cost.mfu, cost.source, pricing.device,
                       str((cell.raw.get("train") or {}).get("objective", "supervised")))


def _masked_patch(cell: Cell) -> tuple[int, int] | None:
    """(corrupted patches, outputs per patch) of a cell pre-trained by masked patch prediction, else None:
    the objective's head is part of the cell's compute (`train/objective.py`)."""
    train = cell.raw.get("train") or {}
    if train.get("objective", "supervised") != "masked_patch":
        return None
    from vitscale.config.loader import build_section
    from vitscale.models.config import ModelConfig
    from vitscale.train.config import MaskedPatchConfig
    from vitscale.train.objective import masked_patch_plan

    settings = build_section(MaskedPatchConfig, train.get("masked_patch"), "train.masked_patch")
    corruption, target = masked_patch_plan(ModelConfig.from_mapping(cell.raw["model"]), settings)
    return corruption.counts[0], target.outputs


def plan_study(cells: list[Cell], data: DataFacts, max_exaflops: float | None,
               pricing: Pricing | None = None) -> list[PlannedCell]:
    """Every cell's plan; refused in one line when the total exceeds `max_exaflops`."""
    planned = [plan_cell(cell, data, pricing) for cell in cells]
    total = sum(p.exaflops for p in planned)
    if max_exaflops is not None and total > max_exaflops:
        biggest = max(planned, key=lambda p: p.exaflops)
        raise ConfigError("study.max_exaflops", f"the study plans {total:.4g} exaFLOPs over {len(planned)} cells, "
                                                f"above its budget of {max_exaflops:g} (largest cell: {biggest.id}, "
                                                f"{biggest.exaflops:.4g})")
    return planned


def _hours(h: float | None) -> str:
    if h is None:
        return ""
    return f"{h * 60:.1f} min" if h < 1 else f"{h:,.3g} h"


def plan_markdown(planned: list[PlannedCell], data: DataFacts, pricing: Pricing | None = None) -> str:
    """The plan as a table (compute, device-hours, devices, wall time, cost, and the speed's
    source per cell), with the study's totals."""
    from vitscale.eval.tables import markdown_table

    pricing = pricing or Pricing()
    priced = any(p.cost is not None for p in planned)
    rows = []
    for p in planned:
        row = {"cell": p.id, "model": p.label, "epochs": f"{p.epochs:g}", "examples": f"{p.examples:,}",
               "img_size": p.img_size, "GFLOPs/example (train)": f"{p.train_gflops_per_example:,.2f}",
               "exaFLOPs": f"{p.exaflops:,.4g}",
               "device-hours": "" if p.device_hours is None else f"{p.device_hours:,.3g}",
               "devices": f"{p.devices:g}", "wall": _hours(p.wall_hours)}
        if priced:
            row["cost"] = "" if p.cost is None else f"{p.cost:,.2f}"
        row["speed from"] = (f"MFU {p.mfu:.0%}, " if p.mfu is not None else "") + p.cost_source
        row["transfer"] = ", ".join(p.transfer)
        rows.append(row)
    total = sum(p.exaflops for p in planned)
    hours = sum(p.device_hours or 0.0 for p in planned)
    wall = study_wall_hours([p.wall_hours or 0.0 for p in planned], pricing.concurrency)
    text = markdown_table(rows, list(rows[0]) if rows else ["cell"])
    where = " (planned size: the dataset is not readable yet)" if data.planned else ""
    estimated = sum("estimate" in p.cost_source for p in planned)
    text += (f"\n{len(planned)} cells, {total:,.4g} exaFLOPs of pre-training, {hours:,.3g} {pricing.device} "
             f"device-hours ({pricing.devices_per_cell:g} device(s) per cell)"
             + (f", cost {sum(p.cost or 0.0 for p in planned):,.2f}" if priced else "")
             + f"; wall time {_hours(wall)} at {pricing.concurrency} cell(s) at once "
             f"(incl. {pricing.overhead_s:g} s start-up/transfer per cell)"
             + f"; split of {data.examples:,} samples, {data.num_classes:,} classes{where}\n")
    if estimated:
        text += (f"{estimated} of {len(planned)} cells are priced from a default MFU (an estimate): measure with "
                 f"benchmarks/mfu.py into benchmarks/RESULTS.md, or set a cell's `throughput:`\n")
    return text
