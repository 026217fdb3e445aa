"""Results people compare: one table written three ways (parquet, CSV, markdown) and a PNG plot.

Parquet and CSV keep numbers as they are (Unix times, seconds). The markdown is for reading: a column
named `*_at` shows its Unix time as a local date and time, one named `*_s` its seconds as H:MM:SS
(its header without the `_s`).

Pure file output from plain rows (dicts of scalars); no Ray. Used by the sweep stage.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vitscale.data.storage.atomic import atomic_path, write_atomic


def _cell(value: Any) -> Any:
    """A scalar for parquet/CSV: nested values become JSON text."""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, default=str)
    return value


def write_table(rows: Sequence[dict[str, Any]], directory: Path, stem: str) -> list[Path]:
    """`stem`.parquet, `stem`.csv and `stem`.md with one row per dict (columns: union, first-seen order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    flat = [{c: _cell(row.get(c)) for c in columns} for row in rows]
    paths = [directory / f"{stem}.parquet", directory / f"{stem}.csv", directory / f"{stem}.md"]
    # Each file whole or not at all (data/storage/atomic.py): a full disk leaves the previous tables.
    with atomic_path(paths[0]) as tmp:
        pq.write_table(pa.Table.from_pylist(flat) if flat else pa.table({}), tmp)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(flat)
    write_atomic(paths[1], text.getvalue())
    write_atomic(paths[2], markdown_table(flat, columns))
    return paths


def save_figure(fig: Any, path: Path, **savefig: Any) -> Path:
    """``fig.savefig`` to ``path`` whole or not at all (data/storage/atomic.py); the format from its suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or None, **savefig)
    return path


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table for people: times as they read them (module doc); parquet and CSV keep the numbers."""

    def fmt(column: str, value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            if column.endswith("_at"):  # Unix time
                return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
            if column.endswith("_s"):  # a duration in seconds
                return duration(value)
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4g}"
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(_header(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(c, row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def duration(seconds: float) -> str:
    """`H:MM:SS` of a duration; below a minute, seconds with one decimal ("7.3 s")."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    total = round(seconds)
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def _header(column: str) -> str:
    # "wall_time_s" holds seconds; in the markdown it holds H:MM:SS, so the unit leaves its name.
    return column.removesuffix("_s")


def plot_metric(rows: Sequence[dict[str, Any]], x: str, y: str, path: Path, *, log_x: bool = True,
                title: str = "") -> Path:
    """A scatter of `y` against `x` over the rows that have both (e.g. dev accuracy vs learning rate)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    points = sorted((float(r[x]), float(r[y])) for r in rows
                    if isinstance(r.get(x), (int, float)) and isinstance(r.get(y), (int, float)))
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-")
    if log_x and points and min(p[0] for p in points) > 0:
        ax.set_xscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
