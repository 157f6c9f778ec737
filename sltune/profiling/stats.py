"""The statistics behind every measurement: medians, bootstrap confidence intervals, spread.

Step times are skewed (a step is never faster than the hardware, often slower when something else runs),
so sltune reports medians and percentile-bootstrap intervals (as criterion does) rather than means and
normal-theory intervals. Throughput is tokens per step over step time with a fixed token count per step,
so an interval of the median step time maps to one of tokens/s by inversion.

Samples come in groups (the steps of one trial; several trials of one config): the bootstrap resamples
groups first, then steps within each chosen group, so the variation between trials (another process
starting, a warmer cache) widens the interval as it should, not only the step-to-step jitter.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000


def _rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(0 if seed is None else seed)


def cv(samples: Sequence[float]) -> float | None:
    """Coefficient of variation (sample standard deviation over mean); None below two samples."""
    x = np.asarray(samples, dtype=float)
    if x.size < 2 or x.mean() == 0:
        return None
    return float(x.std(ddof=1) / x.mean())


def boot_medians(groups: Sequence[Sequence[float]], resamples: int = RESAMPLES, seed: int | None = None,
                 rng: np.random.Generator | None = None) -> np.ndarray:
    """`resamples` bootstrap replicates of the median of the pooled samples, resampling groups and then
    samples within groups (one group: the plain bootstrap)."""
    rng = rng or _rng(seed)
    groups = [np.asarray(g, dtype=float) for g in groups if len(g)]
    if not groups:
        raise ValueError("no samples")
    if len(groups) == 1:
        return _resampled_medians(groups[0], resamples, rng)
    # replicate i pools, for each slot s, a resample of group picks[i, s]: drawn a group at a time (vectorized;
    # a Python loop over replicates took 0.1-0.2 s a call), padded with NaN where a group is shorter
    width = max(g.size for g in groups)
    picks = rng.integers(0, len(groups), size=(resamples, len(groups)))
    pooled = np.full((resamples, len(groups), width), np.nan)
    for j, g in enumerate(groups):
        rows, slots = np.nonzero(picks == j)
        pooled[rows, slots, :g.size] = g[rng.integers(0, g.size, size=(rows.size, g.size))]
    return np.nanmedian(pooled.reshape(resamples, -1), axis=1)


def _resampled_medians(x: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Medians of `count` bootstrap resamples of x."""
    return np.median(x[rng.integers(0, x.size, size=(count, x.size))], axis=1)


def interval(replicates: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    lo, hi = np.percentile(replicates, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(lo), float(hi)


def median_ci(samples: Sequence[float] | Sequence[Sequence[float]], level: float = LEVEL,
              seed: int | None = None) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median (samples, or groups of samples)."""
    return interval(boot_medians(_as_groups(samples), seed=seed), level)


def ratio_ci(new: Sequence[Sequence[float]], old: Sequence[Sequence[float]], level: float = LEVEL,
             seed: int | None = None) -> tuple[float, tuple[float, float]]:
    """median(new) / median(old) and its bootstrap interval, the two measured independently."""
    rng = _rng(seed)
    a, b = boot_medians(new, rng=rng), boot_medians(old, rng=rng)
    point = float(np.median(np.concatenate([np.asarray(g, float) for g in new])) /
                  np.median(np.concatenate([np.asarray(g, float) for g in old])))
    return point, interval(a / b, level)


def paired_ratio_ci(new: Sequence[Sequence[float]], old: Sequence[Sequence[float]], level: float = LEVEL,
                    seed: int | None = None, resamples: int = RESAMPLES) -> tuple[float, tuple[float, float]]:
    """The median over rounds of median(new_r) / median(old_r), for rounds measured side by side (round r of
    each under the same conditions), and its bootstrap interval: rounds are resampled in pairs, samples
    within each round."""
    if len(new) != len(old) or not new:
        raise ValueError("paired samples need the same, non-zero number of rounds")
    rng = _rng(seed)
    na = [np.asarray(g, float) for g in new]
    oa = [np.asarray(g, float) for g in old]
    point = float(np.median([np.median(x) / np.median(y) for x, y in zip(na, oa)]))
    picks = rng.integers(0, len(na), size=(resamples, len(na)))
    ratios = np.empty(picks.shape)
    for j in range(len(na)):       # every draw of round j at once (a loop over replicates took 0.2 s a call)
        where = picks == j
        count = int(where.sum())
        if count:
            ratios[where] = _resampled_medians(na[j], count, rng) / _resampled_medians(oa[j], count, rng)
    return point, interval(np.median(ratios, axis=1), level)


def _as_groups(samples) -> list[Sequence[float]]:
    samples = list(samples)
    if samples and np.ndim(samples[0]) == 0:
        return [samples]
    return samples
