"""Pure functions over (compute, accuracy) points: the Pareto frontier and the saturating power law.

Figure 5 of the paper draws transfer accuracy against pre-training exaFLOPs and reads off which
family is best for a budget. Past the paper, per family, the transfer error E is fitted against
compute C with the saturating power law of Zhai et al. 2022 ("Scaling Vision Transformers",
Eq. 1):

    E(C) = a * (C + d) ** (-b) + c

c is the error the family saturates at, b how fast it gets there, d shifts small budgets (the
regime where more compute barely helps yet). Four parameters: a family needs at least
`MIN_POINTS` cells at distinct compute for a fit with an uncertainty (one degree of freedom).

Fitting: least squares within documented bounds (`bounds`), from several starts, in compute
normalised by its geometric mean s so that a study in 1e-6 exaFLOPs and one in 1e3 are the same
problem. The bounds, and why:

- a in [1e-9, 1e3] (normalised: the error drop at C = s): errors are in [0, 1], so a drop above
  1e3 at the centre of the data only arises with a huge d, which the next bound excludes;
- b in [0.01, 3]: exponents of vision scaling laws are ~0.2-0.8 (Zhai et al. 2022); past 3 the
  curve is a step, which a handful of cells cannot tell from noise;
- c in [0, min measured error]: the error the family saturates at is at or below every error it
  has measured (E(C) > c everywhere), so the asymptote never promises less than a measured cell;
- d in [0, largest measured compute]: an offset past every cell would put the whole study in the
  flat small-budget regime, where b and d cannot be told apart (d = 0, the plain power law, is the
  model's own limit and is not flagged as a bound).

A fit whose optimum sits on a bound, that has fewer than `WELL_DETERMINED` cells, or whose
Jacobian is ill-conditioned (`COND_LIMIT`) is flagged (`PowerLawFit.warnings`): the report and
`recommend` print the warnings. Uncertainty is a bootstrap over cells (`uncertainty.py`): refit on
cells resampled with replacement, percentile intervals on every parameter and on predictions.
Standard errors from the Jacobian (s^2 (J^T J)^-1, the linearised covariance, mapped back to
exaFLOPs by the delta method) are kept alongside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

MIN_POINTS = 5
"""Distinct compute values a family needs for a fit: 4 parameters and one degree of freedom."""
WELL_DETERMINED = 8
"""Cells below which a fit is flagged as weakly determined (two per parameter)."""
COND_LIMIT = 1e6
"""Condition number of the Jacobian (normalised units) above which the fit is flagged: the data
cannot separate the parameters (J^T J's is this squared)."""
PARAMETERS = ("a", "b", "c", "d")


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
    min_compute: float = 0.0
    """The smallest compute fitted: predictions below it are extrapolations too."""
    condition: float = 1.0
    """Condition number of the Jacobian at the optimum (normalised compute)."""
    on_bound: tuple[str, ...] = ()
    """Parameters whose optimum sits on a bound."""
    warnings: tuple[str, ...] = ()
    """Why the fit is not identifiable, if it is not (empty: no warning)."""
    intervals: tuple[tuple[float, float], ...] = ()
    """95% bootstrap intervals of a, b, c, d (empty: no bootstrap)."""
    samples: tuple[tuple[float, float, float, float], ...] = ()
    """The bootstrap refits' (a, b, c, d), for prediction intervals."""

    def error(self, compute: float | np.ndarray) -> float | np.ndarray:
        return saturating(compute, self.a, self.b, self.c, self.d)

    def accuracy(self, compute: float | np.ndarray) -> float | np.ndarray:
        """1 - error, within [0, 1]: below its data the law's error passes 1 (a (C + d)^-b grows without
        bound as C falls), which no accuracy is; there the prediction is 0, not a negative number."""
        return np.clip(1.0 - self.error(compute), 0.0, 1.0)

    def extrapolates(self, compute: float) -> bool:
        return not self.min_compute <= compute <= self.max_compute

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in ("a", "a_std", "b", "b_std", "c", "c_std", "d", "d_std",
                                                            "points", "rmse")}
        for name, (lo, hi) in zip(PARAMETERS, self.intervals):
            out[f"{name}_lo"], out[f"{name}_hi"] = lo, hi
        out.update(min_compute=self.min_compute, max_compute=self.max_compute, condition=self.condition,
                   bootstrap=len(self.samples), warnings="; ".join(self.warnings) or None)
        return out


class FitRefused(ValueError):
    """A family cannot be fitted; the message says why."""


def bounds(compute: np.ndarray, error: np.ndarray) -> tuple[list[float], list[float]]:
    """The documented bounds (module docstring) of (a, b, c, d) in compute normalised by its geometric mean."""
    scale = float(np.exp(np.mean(np.log(compute))))
    top = float(compute.max()) / scale
    c_hi = max(float(error.min()), 1e-9)
    return [1e-9, 0.01, 0.0, 0.0], [1e3, 3.0, c_hi, top]


def fit_power_law(compute: Sequence[float], error: Sequence[float]) -> PowerLawFit:
    """Fit E = a (C + d)^-b + c to (compute, error) points (compute > 0, error in [0, 1]); the intervals
    of a bootstrap over the cells are `uncertainty.fit_with_intervals`'."""
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
    best, lower, upper = _least_squares(x / scale, y, None)
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
    singular = np.linalg.svd(jac, compute_uv=False)
    condition = float(singular[0] / singular[-1]) if singular[-1] > 0 else math.inf
    # d = 0 is the plain power law, the model's own limit rather than a constraint: not flagged.
    def near(v: float, edge: float) -> bool:
        return abs(v - edge) <= 1e-6 * max(1.0, abs(edge))

    on_bound = tuple(name for name, v, lo, hi in zip(PARAMETERS, best.x, lower, upper)
                     if (near(v, lo) and name != "d") or near(v, hi))
    fit = PowerLawFit(a=big_a, b=b, c=c, d=d * scale, a_std=a_std, b_std=float(std[1]), c_std=float(std[2]),
                      d_std=float(std[3]) * scale, points=n, rmse=math.sqrt(rss / n), max_compute=float(x.max()),
                      min_compute=float(x.min()), condition=condition, on_bound=on_bound)
    return replace(fit, warnings=identifiability(fit))


def _least_squares(xs: np.ndarray, y: np.ndarray, start: Sequence[float] | None,
                   max_nfev: int | None = None) -> tuple[Any, list[float], list[float]]:
    """The best least-squares optimum within `bounds` (normalised compute `xs`): from `start`, or
    from a grid of starts."""
    from scipy.optimize import least_squares

    lower, upper = bounds(xs, y)

    def residuals(p: np.ndarray) -> np.ndarray:
        return np.asarray(saturating(xs, p[0], p[1], p[2], p[3])) - y

    inner = [lo + (hi - lo) * 1e-9 if hi > lo else lo for lo, hi in zip(lower, upper)]
    top = [hi - (hi - lo) * 1e-3 if hi > lo else hi for lo, hi in zip(lower, upper)]
    starts: list[Sequence[float]] = []
    if start is not None:
        starts.append(start)
    else:
        for b0 in (0.1, 0.3, 1.0):
            for d0 in (0.0, 0.1, 1.0):
                c0 = max(0.0, float(y.min()) - 0.05)
                a0 = max(1e-6, float(y.max() - c0)) * (float(xs.min()) + d0) ** b0
                starts.append([a0, b0, c0, d0])
    best = None
    for s0 in starts:
        x0 = np.clip(s0, inner, top)
        fit = least_squares(residuals, x0, bounds=(lower, [max(h, lo + 1e-12) for lo, h in zip(lower, upper)]),
                            method="trf", x_scale="jac", max_nfev=max_nfev)
        if best is None or fit.cost < best.cost:
            best = fit
    assert best is not None
    return best, lower, upper


def identifiability(fit: PowerLawFit) -> tuple[str, ...]:
    """Why a fit's parameters are not pinned down by its cells (pure): too few cells, an optimum on
    a bound, an ill-conditioned Jacobian. Empty when none applies."""
    out = []
    if fit.points < WELL_DETERMINED:
        out.append(f"{fit.points} cells for 4 parameters (fewer than {WELL_DETERMINED}): weakly determined")
    if fit.on_bound:
        out.append(f"{', '.join(fit.on_bound)} on a bound of the fit (fit.py's bounds): the data do not pin "
                   f"{'it' if len(fit.on_bound) == 1 else 'them'} down")
    if not math.isfinite(fit.condition) or fit.condition > COND_LIMIT:
        out.append(f"condition number {fit.condition:.2g} of the Jacobian (> {COND_LIMIT:.0e}): the parameters "
                   f"trade off against each other")
    return tuple(out)
