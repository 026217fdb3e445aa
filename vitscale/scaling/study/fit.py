"""Pure functions over (compute, accuracy) points: the Pareto frontier and the saturating power law.

Figure 5 of the paper draws transfer accuracy against pre-training exaFLOPs and reads off which
family is best for a budget. Past the paper, per family, the transfer error E is fitted against
compute C with the saturating power law of Zhai et al. 2022 ("Scaling Vision Transformers",
Eq. 1):

    E(C) = a * (C + d) ** (-b) + c

c is the error the family saturates at, b how fast it gets there, d shifts small budgets (the
regime where more compute barely helps yet). Four parameters: a family needs at least
`MIN_POINTS` cells at distinct compute for a fit with an uncertainty (one degree of freedom).

Fitting: least squares with bounds (a, b > 0; 0 <= c <= 1; d >= 0) from several starts, in
compute normalised by its geometric mean so that a study in 1e-6 exaFLOPs and one in 1e3 are the
same problem; parameter standard errors from the Jacobian at the optimum (s^2 (J^T J)^-1, the
usual linearised covariance), mapped back to exaFLOPs by the delta method.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_POINTS = 5
"""Distinct compute values a family needs for a fit: 4 parameters and one degree of freedom."""


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no cheaper-or-equal point beats: sorted by compute, accuracy strictly rising."""
    frontier: list[tuple[float, float]] = []
    for compute, accuracy in sorted(points, key=lambda p: (p[0], -p[1])):
        if not frontier or accuracy > frontier[-1][1]:
            frontier.append((compute, accuracy))
    return frontier


def saturating(c: np.ndarray | float, a: float, b: float, e_inf: float, d: float) -> np.ndarray | float:
    """E(C) = a (C + d)^-b + c (here `e_inf` is c, the saturation error)."""
    return a * np.power(np.asarray(c, dtype=float) + d, -b) + e_inf


@dataclass(frozen=True)
class PowerLawFit:
    """E(C) = a (C + d)^-b + c with standard errors; C in exaFLOPs, E = 1 - accuracy."""

    a: float
    b: float
    c: float
    d: float
    a_std: float
    b_std: float
    c_std: float
    d_std: float
    points: int
    rmse: float
    """Root mean squared error of the fit over its points (in error units)."""
    max_compute: float
    """The largest compute fitted: predictions beyond it are extrapolations."""

    def error(self, compute: float | np.ndarray) -> float | np.ndarray:
        return saturating(compute, self.a, self.b, self.c, self.d)

    def row(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("a", "a_std", "b", "b_std", "c", "c_std", "d", "d_std", "points", "rmse")}


class FitRefused(ValueError):
    """A family cannot be fitted; the message says why."""


def fit_power_law(compute: Sequence[float], error: Sequence[float]) -> PowerLawFit:
    """Fit E = a (C + d)^-b + c to (compute, error) points (compute > 0, error in [0, 1])."""
    from scipy.optimize import least_squares

    x = np.asarray(compute, dtype=float)
    y = np.asarray(error, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise FitRefused("compute and error must be equal-length lists")
    if not (np.all(np.isfinite(x)) and np.all(x > 0) and np.all(np.isfinite(y))):
        raise FitRefused("every point needs a positive finite compute and a finite error")
    distinct = len(np.unique(x))
    if distinct < MIN_POINTS:
        raise FitRefused(f"{distinct} distinct compute value(s); a fit of 4 parameters needs at least {MIN_POINTS}")
    scale = float(np.exp(np.mean(np.log(x))))
    xs = x / scale

    def residuals(p: np.ndarray) -> np.ndarray:
        return saturating(xs, p[0], p[1], p[2], p[3]) - y

    lower, upper = [1e-9, 1e-4, 0.0, 0.0], [1e3, 5.0, 1.0, 1e3]
    best = None
    for b0 in (0.1, 0.3, 1.0):
        for d0 in (0.0, 0.1, 1.0):
            c0 = max(0.0, float(y.min()) - 0.05)
            a0 = max(1e-6, float(y.max() - c0)) * (float(xs.min()) + d0) ** b0
            start = np.clip([a0, b0, c0, d0], lower, [u * 0.999 for u in upper])
            fit = least_squares(residuals, start, bounds=(lower, upper), method="trf", x_scale="jac")
            if best is None or fit.cost < best.cost:
                best = fit
    assert best is not None
    a, b, c, d = (float(v) for v in best.x)
    n, p = len(x), 4
    rss = float(np.sum(best.fun**2))
    jac = best.jac
    cov = np.linalg.pinv(jac.T @ jac) * (rss / (n - p))
    std = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    # Back to exaFLOPs: a (C/s + d')^-b = a s^b (C + d' s)^-b, so A = a s^b and D = d' s.
    big_a = a * scale**b
    grad = np.array([scale**b, big_a * math.log(scale), 0.0, 0.0])
    a_std = float(math.sqrt(max(0.0, grad @ cov @ grad)))
    return PowerLawFit(a=big_a, b=b, c=c, d=d * scale, a_std=a_std, b_std=float(std[1]), c_std=float(std[2]),
                       d_std=float(std[3]) * scale, points=n, rmse=math.sqrt(rss / n), max_compute=float(x.max()))


@dataclass(frozen=True)
class Recommendation:
    family: str
    predicted_accuracy: float
    """1 - the family's fitted error at the budget."""
    extrapolated: bool
    """The budget lies beyond the family's largest fitted compute."""
    best_cell: dict | None
    """The family's best measured cell within the budget (its model, epochs, data size), if any."""


def recommend(budget: float, fits: dict[str, PowerLawFit], cells: Sequence[dict]) -> list[Recommendation]:
    """Families ranked by fitted accuracy at `budget` exaFLOPs, each with its best cell within budget.

    `cells` are result rows with at least family, exaflops and accuracy.
    """
    if not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"the budget must be a positive number of exaFLOPs, got {budget}")
    out = []
    for family, fit in fits.items():
        within = [r for r in cells if r["family"] == family and r.get("exaflops") is not None
                  and r["exaflops"] <= budget and isinstance(r.get("accuracy"), float)]
        best = max(within, key=lambda r: r["accuracy"]) if within else None
        out.append(Recommendation(family, 1.0 - float(fit.error(budget)), budget > fit.max_compute, best))
    return sorted(out, key=lambda r: -r.predicted_accuracy)
