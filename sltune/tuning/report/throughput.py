"""A config's one throughput figure, defined once: the median tokens/s of every timed step of all its trials,
search and confirmation alike, with a 95% interval that resamples trials, then steps (sltune.profiling.stats).

A search trial is one moment of the machine; the confirmation round measures the pick at others (once the
machine got faster mid-job, so the pick's search trial said 13,718 tokens/s and its confirm trials 20,900).
Quoting any one of them as "the best" let each page pick its own; pooling them all is the one number the
job result, GET /jobs/{id}, best.yaml, the pages, the CLI and `compare` all report (they all call this).
"""

from __future__ import annotations

from statistics import median
from typing import Any, Iterable, Sequence

from sltune.profiling.stats import median_ci
from sltune.profiling.timing import step_tokens_per_s


def step_groups(results: Iterable[dict[str, Any]]) -> list[list[float]]:
    """Tokens/s of every timed step, one list per ok TrialResult (as a dict); the others are left out."""
    return [s for r in results if (s := step_tokens_per_s(r))]


def median_of(groups: Sequence[Sequence[float]]) -> float:
    """The figure itself: the median of every step of every group, pooled."""
    return float(median(x for g in groups for x in g))


def figure(results: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """tokens_per_s (median_of), tokens_per_s_ci95 (trials resampled, then steps; seeded, so the same trials
    give the same interval everywhere) and step_seconds (the same median as time), or None without an ok
    trial."""
    results = list(results)
    groups = step_groups(results)
    if not groups:
        return None
    tps = median_of(groups)
    lo, hi = median_ci(groups, seed=0)
    per_step = [r["tokens_per_s"] * r["step_seconds"] for r in results
                if step_tokens_per_s(r) and r.get("step_seconds")]
    return {"tokens_per_s": tps, "tokens_per_s_ci95": [lo, hi],
            "step_seconds": median(per_step) / tps if per_step else None}
