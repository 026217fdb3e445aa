"""The study's figures (matplotlib, files only): Figure 5 and the Sec. 4.3 data-size plot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vitscale.eval.tables import save_figure

MARKERS = {"ViT": "o", "ResNet": "s", "Hybrid": "^", "ViT (masked patch)": "P"}
COLOURS = {"ViT": "tab:blue", "ResNet": "tab:orange", "Hybrid": "tab:green", "ViT (masked patch)": "tab:purple"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_compute(rows: Sequence[dict[str, Any]], metric: str, fits: dict[str, Any],
                 frontier: Callable[[list[tuple[float, float]]], list[tuple[float, float]]], path: Path) -> Path:
    """Figure 5: transfer accuracy vs pre-training exaFLOPs (log x), a marker family per
    architecture family, the Pareto frontier over all cells, and each family's fitted curve
    (solid where measured, dashed with its bootstrap band where extrapolated)."""
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
            _draw_fit(ax, family, fits[family])
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
    save_figure(fig, path)
    plt.close(fig)
    return path


def _draw_fit(ax: Any, family: str, fit: Any) -> None:
    """The fit solid over its measured compute range, dashed beyond it (half a decade below, 4x
    above), with its 95% bootstrap band where it extrapolates, so a reader sees where it is a guess."""
    from vitscale.scaling.study.uncertainty import predict

    colour = COLOURS.get(family)
    inside = np.geomspace(fit.min_compute, fit.max_compute, 60)
    below = np.geomspace(fit.min_compute / 3, fit.min_compute, 20)
    above = np.geomspace(fit.max_compute, fit.max_compute * 4, 30)
    label = (f"{family} fit: E = {fit.a:.3g}(C+{fit.d:.2g})^-{fit.b:.2f} + {fit.c:.3f}"
             + (" (!)" if fit.warnings else ""))
    ax.plot(inside, fit.accuracy(inside), color=colour, alpha=0.8, linewidth=1.2, label=label)
    for xs in (below, above):
        ax.plot(xs, fit.accuracy(xs), color=colour, alpha=0.6, linewidth=1, linestyle="--")
        if fit.samples:
            bands = [predict(fit, float(x)) for x in xs]
            ax.fill_between(xs, [b[1] for b in bands], [b[2] for b in bands], color=colour, alpha=0.12, linewidth=0)
    if fit.samples:
        bands = [predict(fit, float(x)) for x in inside]
        ax.fill_between(inside, [b[1] for b in bands], [b[2] for b in bands], color=colour, alpha=0.08, linewidth=0)


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
    save_figure(fig, path)
    plt.close(fig)
    return path
