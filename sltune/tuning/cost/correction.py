"""Trials correct the step-time prior (sltune.tuning.cost.step_time), as the memory fits correct the memory prior.

A backend's trials give, for each config measured, its predicted step and its measured one. What the prior misses
has two parts, fitted to them by least squares on the relative error:

    measured step  ~  factor x predicted step  +  per_micro_batch x N

`factor` is how far this machine runs the counted work from its calibrated rates (a trial's caches, threads and
allocator are not the probes'); `per_micro_batch` is the seconds each of the N sub-batches (a wrapped backend's
micro-batches) spends beyond that work: the wrappers' hooks and the runtime's bookkeeping, which no rate counts.
Measured on llama-small in float32 (bench/prior_time.py, docs/benchmarks.md), fitted to oneshot's probes' first
round: 0.86x and 0.25 s a micro-batch for DeepSpeed, 0.99x and 0.17 s for FSDP, 1.06x and 0.14 s a sub-batch for
SpeedLoader; the 22 configs the probes did not measure were then predicted within 7% (median; 14% at the 90th
percentile), where the prior alone missed by 34%, and one factor alone (an earlier run) by 16-17%. One trial, or
trials that cannot tell the two apart (or would give either a sign it cannot have), give the factor alone: the median
of their ratios.

The corrected prediction of another config of that backend is its predicted slices times the factor, plus the
per-micro-batch seconds as "other": a slice's work still scales with that config's knobs, and only the rate the
machine runs it at moves.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import numpy as np

from sltune.tuning.cost.step_time import StepTime


@dataclass(frozen=True)
class Correction:
    """What a backend's trials measured against the prior."""

    factor: float                   # measured over predicted work
    per_micro_batch: float          # seconds each sub-batch spends beyond its counted work
    trials: int
    error: float | None = None      # the typical (median) relative error predicting one of the trials from the
                                    # others (from 3 trials; None before): how far to trust it on a config not run

    @classmethod
    def of(cls, pairs: list[tuple[StepTime | None, float, int]]) -> "Correction | None":
        """From (the trial's predicted step, its measured step seconds, its num_sub_batches) of one backend's
        trials; None without one that has both."""
        pairs = [(t, step, n) for t, step, n in pairs if t is not None and step > 0]
        if not pairs:
            return None
        fix = cls._fitted(pairs)
        if len(pairs) < 3:
            return fix
        missed = [abs(cls._fitted(pairs[:i] + pairs[i + 1:]).apply(t, n).seconds / step - 1)
                  for i, (t, step, n) in enumerate(pairs)]
        return dataclasses.replace(fix, error=statistics.median(missed))

    @classmethod
    def _fitted(cls, pairs: list[tuple[StepTime, float, int]]) -> "Correction":
        ratio = statistics.median(step / t.seconds for t, step, _ in pairs)
        if len(pairs) >= 2:
            # relative least squares: each trial's error as a share of its own step
            x = np.array([[t.seconds / step, n / step] for t, step, n in pairs])
            (factor, fixed), *_ = np.linalg.lstsq(x, np.ones(len(pairs)), rcond=None)
            if np.linalg.matrix_rank(x) == 2 and factor > 0 and fixed >= 0:
                return cls(float(factor), float(fixed), len(pairs))
        return cls(ratio, 0.0, len(pairs))

    def apply(self, t: StepTime, num_sub_batches: int) -> StepTime:
        """t corrected: every slice at the factor, each sub-batch's fixed seconds as "other"; the interval scaled
        as its median."""
        slices = {s: v * self.factor for s, v in t.breakdown.items()}
        slices["other"] = slices.get("other", 0.0) + self.per_micro_batch * num_sub_batches
        seconds = sum(slices.values())
        scale = seconds / t.seconds
        return dataclasses.replace(t, seconds=seconds, slowest=t.slowest * scale, fastest=t.fastest * scale,
                                   breakdown=slices)

    def to_dict(self) -> dict[str, object]:
        """As a job's result reports it (step_prior.corrections)."""
        return {"factor": self.factor, "per_micro_batch_s": self.per_micro_batch, "trials": self.trials,
                "error": self.error, "text": self.describe()}

    def describe(self) -> str:
        """'x1.11 the calibrated rates' time, +0.177 s a sub-batch (8 trials)'."""
        return (f"x{self.factor:.2f} the calibrated rates' time, +{self.per_micro_batch:.3f} s a sub-batch "
                f"({self.trials} trial{'s' if self.trials != 1 else ''}"
                + (f"; each predicted from the others within {self.error:.0%}, typically" if self.error is not None
                   else "") + ")")
