"""Timing one piece of work repeatedly within a budget: the samples a Rate is made of."""

from __future__ import annotations

import time
from typing import Callable

SAMPLE_S = 0.02      # a sample lasts at least this long (calls are repeated within it): the clock's noise stays small
MIN_SAMPLES, MAX_SAMPLES = 3, 9


def first_call_s(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """One call, timed: the warm-up every measurement starts with (allocations, kernels chosen, pages touched)."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def per_call_s(fn: Callable[[], object], budget_s: float, sync: Callable[[], None], warm_s: float) -> list[float]:
    """Seconds per call, one figure per sample: as many samples as fit in `budget_s` (3 to 9), each of enough
    calls to last SAMPLE_S. `warm_s` is the warm-up call's time, which sizes the samples."""
    calls = max(1, int(SAMPLE_S / max(warm_s, 1e-9)))
    samples = min(MAX_SAMPLES, max(MIN_SAMPLES, int(budget_s / max(warm_s * calls, 1e-9))))
    out = []
    for _ in range(samples):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out.append((time.perf_counter() - start) / calls)
    return out
