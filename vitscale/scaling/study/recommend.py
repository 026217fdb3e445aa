"""`vitscale study recommend`: which family and cell for a budget, from everything measured (pure).

Every family appears: its best measured cell within the budget (fitted or not: a family with too
few cells for a fit still has measurements, and a measured cell beats a prediction), and, when it
has a fit, the fit's accuracy at the budget with its bootstrap interval, marked as extrapolation
when the budget lies outside the family's measured compute range, and the fit's identifiability
warnings. Families are ranked by the better of the two: what was measured within budget, and what
the fit predicts there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vitscale.config.checks import positive
from vitscale.scaling.study.fit import PowerLawFit
from vitscale.scaling.study.uncertainty import predict


@dataclass(frozen=True)
class Answer:
    """One family's answer for a budget."""

    family: str
    best_cell: dict[str, Any] | None
    """Its best measured cell within the budget (a result row with "accuracy"), if any."""
    predicted: float | None
    """The fit's accuracy at the budget; null without a fit."""
    lo: float | None
    hi: float | None
    """The prediction's 95% bootstrap interval (null without one)."""
    extrapolated: bool
    """The budget lies outside the family's fitted compute range."""
    warnings: tuple[str, ...] = ()
    no_fit: str | None = None
    """Why the family has no fit, when it has none."""

    @property
    def score(self) -> float:
        """What ranks families: the better of the measured best within budget and the prediction."""
        measured = self.best_cell["accuracy"] if self.best_cell else -math.inf
        return max(measured, self.predicted if self.predicted is not None else -math.inf)


def recommend(budget: float, fits: dict[str, PowerLawFit], cells: Sequence[dict[str, Any]],
              refused: dict[str, str] | None = None) -> list[Answer]:
    """Every family with a measured cell or a fit, best first, at `budget` exaFLOPs.

    `cells` are finished result rows with at least family, exaflops and accuracy (a float, or
    None when the cell has no value of the metric).
    """
    positive(budget, "--budget")  # a ConfigError: the CLI's one line (a bare ValueError was a traceback)
    refused = refused or {}
    families = list(dict.fromkeys([*(r["family"] for r in cells), *fits]))
    out = []
    for family in families:
        within = [r for r in cells if r["family"] == family and isinstance(r.get("exaflops"), (int, float))
                  and r["exaflops"] <= budget and isinstance(r.get("accuracy"), float)]
        best = max(within, key=lambda r: r["accuracy"]) if within else None
        fit = fits.get(family)
        if fit is None:
            out.append(Answer(family, best, None, None, None, False, no_fit=refused.get(family, "no fit")))
            continue
        mid, lo, hi = predict(fit, budget)
        out.append(Answer(family, best, mid, lo, hi, fit.extrapolates(budget), fit.warnings))
    out = [a for a in out if a.best_cell is not None or a.predicted is not None or a.no_fit is not None]
    return sorted(out, key=lambda a: -a.score)


def answer_text(answers: list[Answer], budget: float, metric: str, fits: dict[str, PowerLawFit]) -> str:
    """The answers as lines: the pick first, then every other family."""
    lines = [f"budget {budget:g} exaFLOPs; accuracy = {metric} (finished cells; fits with 95% bootstrap intervals)"]
    for i, a in enumerate(answers):
        parts = []
        if a.predicted is not None:
            fit = fits[a.family]
            band = f" [{a.lo:.4f}, {a.hi:.4f}]" if a.lo is not None and a.hi is not None else " (no interval)"
            where = (f"EXTRAPOLATION outside its measured range {fit.min_compute:.3g}-{fit.max_compute:.3g} exaFLOPs"
                     if a.extrapolated else "within its measured range")
            parts.append(f"predicted {a.predicted:.4f}{band} ({where})")
        else:
            parts.append(f"no fit ({a.no_fit})")
        if a.best_cell:
            b = a.best_cell
            size = f"{b['data_size']:,} examples" if isinstance(b.get("data_size"), int) else "all data"
            parts.append(f"best measured cell within budget: {b['model']}, {b['epochs']:g} epochs, {size} "
                         f"({b['accuracy']:.4f} at {b['exaflops']:.3g} exaFLOPs)")
        else:
            parts.append("no measured cell within budget")
        lines.append(f"{'-> ' if i == 0 else '   '}{a.family}: " + "; ".join(parts))
        for warning in a.warnings:
            lines.append(f"      warning: {warning}")
    return "\n".join(lines)
