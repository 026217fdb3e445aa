"""How far a family's fit can be trusted (pure): bootstrap intervals over cells, and a backtest.

Bootstrap: the family's cells are resampled with replacement `n` times and the power law refitted
on each resample (from the full fit's optimum, within the same bounds); a resample with fewer than
`RESAMPLE_DISTINCT` distinct compute values is skipped, and with fewer than a fifth of the
resamples fitted there are no intervals (the fit says so). The 2.5th and 97.5th percentiles of the refits
are the 95% intervals of each parameter, and, evaluated at a compute C, of the prediction there.
Resampling cells (not residuals) keeps the question honest for a handful of cells: how much would
the law move had a different subset of these cells been run.

Backtest ("prediction" vs "projection" in LLM scaling tooling): refit without the cells at the
largest compute and report the error of the refit's prediction for them, and whether the
measured value fell inside its bootstrap interval: the fit's track record at the extrapolation
distance the study itself spans.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vitscale.scaling.study.fit import (
    MIN_POINTS,
    FitRefused,
    PowerLawFit,
    _least_squares,
    fit_power_law,
)

RESAMPLE_DISTINCT = 4
"""Distinct compute values a resample needs to be refitted: the parameter count. Fewer than the
full fit's `MIN_POINTS`, so that a family of 5-7 cells still gets (wide, honest) intervals: a
resample of 5 cells has all 5 distinct only 4% of the time."""
LEVEL = 0.95
"""Coverage of the intervals."""
BOOTSTRAP = 100
"""Resamples per fit in the report (each a refit from the full fit's optimum: ~10 ms)."""


def resample_fits(x: np.ndarray, y: np.ndarray, start: np.ndarray, n: int, seed: int
                  ) -> list[tuple[float, float, float, float]]:
    """(a, b, c, d) in exaFLOPs of up to `n` refits on cells resampled with replacement."""
    rng = np.random.default_rng(seed)
    out: list[tuple[float, float, float, float]] = []
    for _ in range(n):
        pick = rng.integers(0, len(x), len(x))
        xb, yb = x[pick], y[pick]
        if len(np.unique(xb)) < RESAMPLE_DISTINCT:
            continue
        scale = float(np.exp(np.mean(np.log(xb))))
        # The full fit's optimum in this resample's normalised units, as the start.
        a0, b0, c0, d0 = start
        best, _, _ = _least_squares(xb / scale, yb, [a0 / scale**b0, b0, c0, d0 / scale], max_nfev=100)
        a, b, c, d = (float(v) for v in best.x)
        out.append((a * scale**b, b, c, d * scale))
    return out


def percentile_interval(values: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    tail = (1 - level) / 2 * 100
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


def with_bootstrap(fit: PowerLawFit, x: np.ndarray, y: np.ndarray, n: int, seed: int) -> PowerLawFit:
    """`fit` with bootstrap intervals on a, b, c, d (and the refits, for prediction intervals)."""
    samples = resample_fits(x, y, np.array([fit.a, fit.b, fit.c, fit.d]), n, seed)
    if len(samples) < max(10, n // 5):
        why = f"only {len(samples)} of {n} bootstrap resamples could be fitted: no intervals"
        return replace(fit, warnings=(*fit.warnings, why))
    arr = np.array(samples)
    intervals = tuple(percentile_interval(arr[:, i]) for i in range(4))
    return replace(fit, intervals=intervals, samples=tuple(samples))


def fit_with_intervals(compute: Any, error: Any, *, bootstrap: int = BOOTSTRAP, seed: int = 0) -> PowerLawFit:
    """`fit.fit_power_law` of (compute, error); with `bootstrap` > 0, that many refits on cells resampled with
    replacement give its parameters' and predictions' intervals."""
    fit = fit_power_law(compute, error)
    if bootstrap <= 0:
        return fit
    return with_bootstrap(fit, np.asarray(compute, dtype=float), np.asarray(error, dtype=float), bootstrap, seed)


def predict(fit: PowerLawFit, compute: float) -> tuple[float, float | None, float | None]:
    """Accuracy (1 - error, within [0, 1]: `PowerLawFit.accuracy`) at `compute` and its 95% bootstrap interval
    (None, None without one)."""
    mid = float(fit.accuracy(compute))
    if not fit.samples:
        return mid, None, None
    arr = np.array(fit.samples)
    # Every refit at once (numpy broadcasts the parameter columns).
    acc = np.clip(1.0 - (arr[:, 0] * np.power(compute + arr[:, 3], -arr[:, 1]) + arr[:, 2]), 0.0, 1.0)
    lo, hi = percentile_interval(acc)
    return mid, min(lo, mid), max(hi, mid)


@dataclass(frozen=True)
class BacktestRow:
    compute: float
    measured: float
    """Measured accuracy of the held-out cell."""
    predicted: float
    """The refit's accuracy at its compute."""
    lo: float | None
    hi: float | None

    @property
    def error(self) -> float:
        return self.predicted - self.measured

    @property
    def covered(self) -> bool | None:
        return None if self.lo is None or self.hi is None else self.lo <= self.measured <= self.hi

    def row(self) -> dict[str, Any]:
        return {"compute": self.compute, "measured": self.measured, "predicted": self.predicted,
                "error": self.error, "lo": self.lo, "hi": self.hi, "covered": self.covered}


def backtest_split(compute: np.ndarray, holdout: int) -> tuple[np.ndarray, np.ndarray]:
    """Masks (train, held out): the cells at the `holdout` largest distinct compute values are held out."""
    top = np.unique(compute)[-holdout:] if holdout > 0 else np.array([])
    held = np.isin(compute, top)
    return ~held, held


def backtest(compute: Any, accuracy: Any, *, holdout: int = 1, bootstrap: int = BOOTSTRAP,
             seed: int = 0) -> list[BacktestRow]:
    """Refit without the largest-compute cell(s); the refit's prediction for each held-out cell.
    Refused (FitRefused) when too few cells remain to fit."""
    x, acc = np.asarray(compute, dtype=float), np.asarray(accuracy, dtype=float)
    train, held = backtest_split(x, holdout)
    if len(np.unique(x[train])) < MIN_POINTS:
        raise FitRefused(f"a backtest needs {MIN_POINTS} distinct compute values besides the {holdout} held out; "
                         f"there are {len(np.unique(x[train]))}")
    fit = fit_with_intervals(x[train], 1.0 - acc[train], bootstrap=bootstrap, seed=seed)
    out = []
    for c, a in zip(x[held], acc[held]):
        mid, lo, hi = predict(fit, float(c))
        out.append(BacktestRow(float(c), float(a), mid, lo, hi))
    return out
