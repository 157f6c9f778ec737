"""The statistics trials report: intervals that cover at their stated rate, pairing that removes shared
drift, the coefficient of variation."""

import numpy as np
import pytest

from sltune.profiling.stats import cv, median_ci, paired_ratio_ci, ratio_ci


def test_bootstrap_interval_of_the_median_covers_at_about_the_stated_rate():
    rng = np.random.default_rng(1)
    true_median = np.exp(0.0)                      # lognormal(0, 0.3): skewed, like step times
    trials = 300
    covered = sum(lo <= true_median <= hi for lo, hi in
                  (median_ci(rng.lognormal(0.0, 0.3, size=40), seed=i) for i in range(trials)))
    assert 0.90 <= covered / trials <= 0.99, covered / trials


def test_ratio_interval_covers_a_known_ratio_and_excludes_a_real_one():
    rng = np.random.default_rng(2)
    hits = 0
    for i in range(100):
        old = [rng.lognormal(0.0, 0.2, 30)]
        new = [1.1 * rng.lognormal(0.0, 0.2, 30)]
        _, (lo, hi) = ratio_ci(new, old, seed=i)
        hits += lo <= 1.1 <= hi
    assert hits >= 88, hits
    point, (lo, hi) = ratio_ci([rng.lognormal(0.0, 0.05, 40)], [rng.lognormal(np.log(2), 0.05, 40)])
    assert hi < 0.6 and point == pytest.approx(0.5, rel=0.05)


def test_pairing_removes_drift_shared_by_both_sides():
    rng = np.random.default_rng(3)
    drift = [1.0, 0.6, 1.4, 0.8]                   # a hog comes and goes: every round slows both configs alike
    a = [d * 1.05 * rng.lognormal(0, 0.02, 15) for d in drift]
    b = [d * rng.lognormal(0, 0.02, 15) for d in drift]
    point, (lo, hi) = paired_ratio_ci(a, b)
    assert point == pytest.approx(1.05, rel=0.02) and 1.0 < lo <= 1.05 <= hi < 1.1
    _, (ulo, uhi) = ratio_ci(a, b)                 # unpaired, the drift swamps the 5%
    assert ulo < 1.0 and uhi - ulo > 3 * (hi - lo)


def test_cv():
    assert cv([1.0]) is None
    assert cv([1.0, 1.0, 1.0]) == 0.0
    assert cv([1.0, 3.0]) == pytest.approx(np.std([1, 3], ddof=1) / 2)
