"""The study's figures (matplotlib, files only): Figure 5 and the Sec. 4.3 data-size plot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MARKERS = {"ViT": "o", "ResNet": "s", "Hybrid": "^"}
COLOURS = {"ViT": "tab:blue", "ResNet": "tab:orange", "Hybrid": "tab:green"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_compute(rows: Sequence[dict[str, Any]], metric: str, fits: dict[str, Any],
                 frontier: Callable[[list[tuple[float, float]]], list[tuple[float, float]]], path: Path) -> Path:
    """Figure 5: transfer accuracy vs pre-training exaFLOPs (log x), a marker family per
    architecture family, the Pareto frontier over all cells, and each family's fitted curve."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=130)
    points = []
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [(r["exaflops"], r[metric], r["model"]) for r in rows if r["family"] == family and not r["partial"]
                and isinstance(r.get(metric), float) and isinstance(r.get("exaflops"), (int, float))]
        if not mine:
            continue
        points += [(c, a) for c, a, _ in mine]
        ax.scatter([m[0] for m in mine], [m[1] for m in mine], marker=MARKERS.get(family, "D"),
                   color=COLOURS.get(family), label=family, s=42, zorder=3)
        for c, a, label in mine:
            ax.annotate(label, (c, a), fontsize=6, xytext=(3, 3), textcoords="offset points", alpha=0.7)
        if family in fits:
            fit = fits[family]
            lo = min(m[0] for m in mine)
            xs = np.geomspace(lo / 2, fit.max_compute * 4, 100)
            ax.plot(xs, 1.0 - fit.error(xs), color=COLOURS.get(family), alpha=0.6, linewidth=1,
                    label=f"{family} fit: E = {fit.a:.3g}(C+{fit.d:.2g})^-{fit.b:.2f} + {fit.c:.3f}")
    if points:
        front = frontier(points)
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="grey", linestyle="--",
                linewidth=1, label="Pareto frontier")
        ax.set_xscale("log")
    ax.set_xlabel("pre-training compute (exaFLOPs)")
    ax.set_ylabel(metric)
    ax.set_title(f"Transfer accuracy vs pre-training compute ({len(points)} cells)", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="best", framealpha=0.6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_data_size(rows: Sequence[dict[str, Any]], metric: str, path: Path) -> Path:
    """Sec. 4.3 (Figures 3-4): transfer accuracy vs pre-training data size, one line per model and epochs."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.2), dpi=130)
    series: dict[tuple[str, str, float], list[tuple[int, float]]] = {}
    for r in rows:
        if not r["partial"] and isinstance(r.get(metric), float):
            series.setdefault((r["family"], r["model"], r["epochs"]), []).append((r["data_size"], r[metric]))
    palette = plt.get_cmap("tab10")
    for i, ((family, model, epochs), pts) in enumerate(series.items()):  # a colour per series, a marker per family
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=MARKERS.get(family, "D"),
                color=palette(i % 10), alpha=0.85, label=f"{model}, {epochs:g} ep")
    ax.set_xscale("log")
    ax.set_xlabel("pre-training examples (first N of a fixed permutation)")
    ax.set_ylabel(metric)
    ax.set_title("Transfer accuracy vs pre-training data size", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    if series:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
