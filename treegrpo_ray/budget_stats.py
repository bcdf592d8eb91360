"""The statistics of the budget suite: confidence intervals over seeds, curves matched on a cost.

Pure functions over floats, tested by hand (tests/unit/test_budget_stats.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

POWER = 0.8  # for the smallest detectable difference
ALPHA = 0.05  # two-sided: 95% confidence intervals


@dataclass(frozen=True)
class Estimate:
    """Mean over seeds with the half-width of its 95% t-interval (NaN with one seed)."""

    mean: float
    half_width: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "ci95": self.half_width, "n": self.n}


def mean_ci(values: Sequence[float], alpha: float = ALPHA) -> Estimate:
    """Mean and t-interval half-width ``t(1 - alpha/2, n-1) * sd / sqrt(n)`` (sd with n - 1; 95%
    by default, a smaller ``alpha`` for a Bonferroni correction)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_ci needs at least one value")
    mean = statistics.fmean(values)
    if n == 1:
        return Estimate(mean, math.nan, 1)
    t = stats.t.ppf(1 - alpha / 2, n - 1)
    return Estimate(mean, float(t * statistics.stdev(values) / math.sqrt(n)), n)


def detectable_difference(differences: Sequence[float]) -> float:
    """Smallest true mean difference a paired t-test over these seeds detects with 80% power at
    the 5% level: ``(t(0.975, n-1) + t(0.8, n-1)) * sd / sqrt(n)``; NaN with fewer than 2."""
    n = len(differences)
    if n < 2:
        return math.nan
    t_sum = stats.t.ppf(1 - ALPHA / 2, n - 1) + stats.t.ppf(POWER, n - 1)
    return float(t_sum * statistics.stdev(differences) / math.sqrt(n))


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """``y`` at ``x`` on the piecewise-linear curve through (xs, ys); xs increasing, x within."""
    if not xs[0] <= x <= xs[-1] + 1e-9 * abs(xs[-1]):
        raise ValueError(f"x={x} is outside the curve's range [{xs[0]}, {xs[-1]}]")
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def matched_difference(
    curve_a: tuple[Sequence[float], Sequence[float]],
    curve_b: tuple[Sequence[float], Sequence[float]],
) -> tuple[float, float]:
    """``(a - b, x)`` at the largest cost ``x`` both curves reached (each curve: costs from 0
    upwards, and the metric there): the run that spent more is read where the other stopped."""
    x = min(curve_a[0][-1], curve_b[0][-1])
    return interpolate(*curve_a, x) - interpolate(*curve_b, x), x
