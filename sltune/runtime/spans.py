"""Time covered by a set of intervals, overlaps counted once: the profiler's breakdown slices and the disk tier's
busy and hidden times both ask it."""

from __future__ import annotations

from typing import Iterable


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total
