"""The budget suite's statistics, by hand."""

import math

import pytest

from treegrpo_ray.budget_stats import (
    detectable_difference,
    interpolate,
    matched_difference,
    mean_ci,
)


def test_mean_ci_is_the_t_interval():
    estimate = mean_ci([1.0, 2.0, 3.0])
    # mean 2, sd 1, t(0.975, 2) = 4.302653 -> half-width 4.302653 / sqrt(3) = 2.484138
    assert estimate.mean == 2.0
    assert estimate.half_width == pytest.approx(2.484138, abs=1e-6)
    assert (estimate.low, estimate.high) == pytest.approx((2 - 2.484138, 2 + 2.484138), abs=1e-6)
    single = mean_ci([0.4])
    assert single.mean == 0.4 and math.isnan(single.half_width)
    with pytest.raises(ValueError, match="at least one"):
        mean_ci([])


def test_detectable_difference_is_paired_t_at_80_percent_power():
    # (t(0.975, 2) + t(0.8, 2)) * sd / sqrt(n) = (4.302653 + 1.060660) * 1 / sqrt(3) = 3.096510
    assert detectable_difference([1.0, 2.0, 3.0]) == pytest.approx(3.096510, abs=1e-6)
    assert math.isnan(detectable_difference([1.0]))


def test_interpolate_is_piecewise_linear():
    xs, ys = [0.0, 10.0, 20.0], [0.5, 0.7, 0.6]
    assert interpolate(xs, ys, 5.0) == pytest.approx(0.6)
    assert interpolate(xs, ys, 15.0) == pytest.approx(0.65)
    assert interpolate(xs, ys, 20.0) == 0.6
    assert interpolate([0.0, 0.0, 4.0], [0.1, 0.3, 0.5], 0.0) == 0.1  # a repeated cost
    with pytest.raises(ValueError, match="outside"):
        interpolate(xs, ys, 21.0)


def test_matched_difference_reads_the_costlier_run_where_the_other_stopped():
    more = ([0.0, 10.0, 30.0], [0.5, 0.7, 0.9])  # spent 30
    less = ([0.0, 20.0], [0.5, 0.6])  # spent 20: compare at 20, where `more` had 0.8
    diff, at = matched_difference(more, less)
    assert at == 20.0
    assert diff == pytest.approx(0.8 - 0.6)
    diff, at = matched_difference(less, more)
    assert (diff, at) == (pytest.approx(0.6 - 0.8), 20.0)
