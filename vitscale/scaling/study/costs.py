"""What a cell costs before it runs: device-hours from its FLOPs, wall time, and money (pure).

    device-hours = FLOPs / (device peak x MFU) / 3600

The paper counts pre-training compute in exaFLOPs (Table 6); what a person budgets is GPU-hours
and money, and those depend on the model: a ViT-H/14 cell of 4,262 exaFLOPs takes ~3,000 H100
hours at 40% MFU, a ViT-B/32 cell of 56 exaFLOPs ~40. So each cell is priced from its own FLOPs,
with the MFU taken, in this order, from:

1. a measured throughput of the cell (`throughput:` images/s per device in its entry, or
   `study.throughput`): device time = examples seen / throughput ("measured throughput");
2. a measured MFU table, `benchmarks/RESULTS.md` (the markdown table `benchmarks/mfu.py` prints:
   columns `model` and `MFU`, optionally `device`), for the cell's model on the study's device;
   a row for another size of the same family is used when the model has none ("measured, same
   family");
3. `DEFAULT_MFU`, per device class and family: an estimate, labelled so.

Each figure carries its source as text, so a plan never passes an estimate off as a measurement.
Wall time = device time / devices per cell + `overhead_s` (start-up, teardown and transfer, which
FLOPs do not count); the study's wall time assumes `concurrency` cells at once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from vitscale.train.mfu import PEAK_BF16_FLOPS, device_key

PEAK_FLOPS: dict[str, float] = {**PEAK_BF16_FLOPS, "V100": 125e12, "TPUV3": 123e12, "CPU": 100e9}
"""Dense peak FLOP/s per device: bf16 tensor cores on GPUs (NVIDIA data sheets: the table MFU is measured
against, `train.mfu.PEAK_BF16_FLOPS`, and a V100's), a TPUv3 chip (the paper's hardware, 123 TFLOP/s bf16), and one
CPU core's fp32 FMA peak, an estimate (2 AVX2 FMA units x 8 lanes x 2 FLOPs x ~3 GHz)."""

DEFAULT_MFU: dict[str, dict[str, float]] = {
    "gpu": {"vit": 0.40, "hybrid": 0.35, "resnet": 0.30},
    "cpu": {"vit": 0.25, "hybrid": 0.22, "resnet": 0.15},
}
"""MFU when nothing is measured: estimates. GPU: ~40% is what well-tuned ViT training reaches in
bf16 on H100-class GPUs (benchmarks/mfu.py's target is 45-50% for B/16 and L/16); convolutional
ResNets (BatchNorm, small channel counts early) and hybrids sit lower. CPU: measured once on this
project's 2-core machine for the local study's tiny models in fp32 (ViTs 24-34 GFLOP/s per core,
the ResNet 16, the hybrid 27; 2026-11), rounded down for data loading."""

DEFAULT_OVERHEAD_S = {"gpu": 120.0, "cpu": 60.0}
"""Seconds per cell that FLOPs do not count: Ray Train start-up and teardown, checkpoints, the
transfer probes. CPU: the local study's ~65 s per cell on an unloaded 2-core machine, less the probe's
own Ray task it no longer starts (benchmarks/study_overhead.py, docs/study.md); GPU: an estimate
(larger models take longer to build, checkpoint and probe)."""


@dataclass(frozen=True)
class CellCost:
    """A cell's planned device time, wall time and money, with where its speed came from."""

    devices: float
    device_hours: float
    wall_hours: float
    """Its own wall time: device time over its devices, plus the per-cell overhead."""
    cost: float | None
    """device_hours x price; null without a price."""
    mfu: float | None
    """The MFU assumed (null when priced from a measured throughput)."""
    source: str
    """Where the speed came from: "measured throughput", "benchmarks/RESULTS.md ...", "estimate ..."."""


def device_class(device: str) -> str:
    return "cpu" if device.upper() == "CPU" else "gpu"


def peak_flops(device: str) -> float:
    """The device's peak FLOP/s (`train.mfu.device_key`: the longest name of `PEAK_FLOPS` in it, not
    inside a longer number: "h100-pcie" is an H100 PCIe, "H1000" nothing); unknown names are refused."""
    key = device_key(device, PEAK_FLOPS)
    if key is None:
        raise ValueError(f"no peak FLOP/s known for device {device!r}; known: {', '.join(PEAK_FLOPS)}")
    return PEAK_FLOPS[key]


@dataclass(frozen=True)
class MeasuredMFU:
    model: str
    mfu: float
    device: str | None


def parse_mfu_table(text: str) -> list[MeasuredMFU]:
    """Rows of every markdown table in `text` with a `model` and an `MFU` column (pure).

    Robust to what a results file holds besides: other tables, prose, blank cells, "45.3%" or
    "0.453", extra columns; a row whose MFU does not parse as a fraction in (0, 1] is skipped.
    """
    out: list[MeasuredMFU] = []
    header: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if all(re.fullmatch(r":?-+:?", c) for c in cells if c):
            continue
        row = dict(zip(header, cells))
        if "model" not in row or "mfu" not in row:
            continue
        mfu = _fraction(row["mfu"])
        if mfu is not None and row["model"]:
            out.append(MeasuredMFU(row["model"], mfu, row.get("device") or None))
    return out


def _fraction(text: str) -> float | None:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%?)\s*", text)
    if not m:
        return None
    value = float(m.group(1)) / (100 if m.group(2) else 1)
    return value if 0 < value <= 1 else None


def read_mfu_table(path: Path) -> list[MeasuredMFU]:
    """`parse_mfu_table` of a file; none when it does not exist or cannot be read."""
    try:
        return parse_mfu_table(path.read_text())
    except (OSError, UnicodeDecodeError):
        return []


def choose_mfu(model: str, family: str, device: str, table: list[MeasuredMFU], source: str) -> tuple[float, str]:
    """The MFU for `model` on `device` and where it came from (pure): the model's measured row,
    else the mean of its family's measured rows, else the default estimate."""

    def same_device(row: MeasuredMFU) -> bool:
        if row.device is None:
            return True
        try:
            return device_class(row.device) == device_class(device) and (
                device_class(device) == "cpu" or peak_flops(row.device) == peak_flops(device))
        except ValueError:
            return False

    rows = [r for r in table if same_device(r)]
    exact = [r.mfu for r in rows if r.model.upper() == model.upper()]
    if exact:
        return sum(exact) / len(exact), f"measured ({source}, {model})"
    kin = [r.mfu for r in rows if _family(r.model) == family]
    if kin:
        return sum(kin) / len(kin), f"measured, same family ({source}, {len(kin)} row(s))"
    default = DEFAULT_MFU[device_class(device)][family]
    return default, f"estimate (default {family} MFU on {device_class(device).upper()}, docs/study.md)"


def _family(model: str) -> str | None:
    from vitscale.models.variants import parse_model_name

    try:
        return parse_model_name(model).family
    except ValueError:
        return None


def cell_cost(*, exaflops: float, examples_seen: int, devices: float, device: str, mfu: float, mfu_source: str,
              throughput: float | None, overhead_s: float, price: float | None) -> CellCost:
    """One cell's cost (pure): from a measured throughput when given, else from FLOPs and MFU."""
    if devices <= 0 or not math.isfinite(exaflops) or exaflops < 0:
        raise ValueError(f"need devices > 0 and exaflops >= 0, got {devices}, {exaflops}")
    if throughput:
        device_s, used_mfu = examples_seen / throughput, None
        source = f"measured throughput ({throughput:g} images/s per device)"
    else:
        device_s, used_mfu, source = exaflops * 1e18 / (peak_flops(device) * mfu), mfu, mfu_source
    hours = device_s / 3600
    wall = device_s / devices / 3600 + overhead_s / 3600
    return CellCost(devices, hours, wall, None if price is None else hours * price, used_mfu, source)


def study_wall_hours(cell_walls: list[float], concurrency: int) -> float:
    """The study's wall time with `concurrency` cells at once (pure): each cell, in plan order,
    starts on the first free slot, as the runner schedules them."""
    lanes = [0.0] * max(1, concurrency)
    for wall in cell_walls:
        lanes[lanes.index(min(lanes))] += wall
    return max(lanes)
