"""Results people compare: one table written three ways (parquet, CSV, markdown) and a PNG plot.

Pure file output from plain rows (dicts of scalars); no Ray. Used by the sweep stage.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


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
    pq.write_table(pa.Table.from_pylist(flat) if flat else pa.table({}), paths[0])
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(flat)
    paths[2].write_text(markdown_table(flat, columns))
    return paths


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4g}"
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
