"""Trials correct the step-time prior (sltune.tuning.cost.correction): the calibrated rates' time scaled by a factor,
and a fixed cost per sub-batch no rate counts, fitted to a backend's trials."""

from __future__ import annotations

import pytest

from sltune.tuning.cost.correction import Correction
from sltune.tuning.cost.step_time import SLICES, StepTime


def step(compute: float, cpu: float = 0.0) -> StepTime:
    breakdown = dict.fromkeys(SLICES, 0.0) | {"compute": compute, "cpu": cpu}
    seconds = compute + cpu
    return StepTime(seconds, 1.2 * seconds, 0.8 * seconds, breakdown, tokens=128)


def test_a_factor_and_a_cost_per_sub_batch_are_fitted_to_the_trials_and_carried_to_another_config():
    """Trials that ran 1.5x their predicted work plus 0.1 s a sub-batch: both are found, and another config's
    prediction gets its own work at 1.5x and its own sub-batches' fixed cost."""
    trials = [(step(1.0, 0.2), 1.5 * 1.2 + 0.1 * 1, 1), (step(2.0), 1.5 * 2.0 + 0.1 * 2, 2),
              (step(4.0), 1.5 * 4.0 + 0.1 * 1, 1)]
    fix = Correction.of(trials)
    assert fix.factor == pytest.approx(1.5) and fix.per_micro_batch == pytest.approx(0.1) and fix.trials == 3
    fixed = fix.apply(step(8.0, 0.4), num_sub_batches=4)
    assert fixed.breakdown["compute"] == pytest.approx(12.0) and fixed.breakdown["cpu"] == pytest.approx(0.6)
    assert fixed.breakdown["other"] == pytest.approx(0.4)
    assert fixed.seconds == pytest.approx(13.0) and fixed.tokens_per_s == pytest.approx(128 / 13.0)
    assert fixed.fastest < fixed.seconds < fixed.slowest
    assert fix.error == pytest.approx(0.0, abs=1e-9)      # each trial predicted exactly from the other two
    assert fix.describe() == ("x1.50 the calibrated rates' time, +0.100 s a sub-batch (3 trials; each predicted "
                              "from the others within 0%, typically)")
    assert fix.to_dict() == {"factor": pytest.approx(1.5), "per_micro_batch_s": pytest.approx(0.1), "trials": 3,
                             "error": fix.error, "text": fix.describe()}


def test_its_error_is_how_far_each_trial_lies_from_the_correction_of_the_others():
    """Four trials of the same sub-batches at 1.0x, 1.2x, 1.0x, 1.2x their prediction: each one left out is predicted
    at the others' median ratio, 1.2x, 1.0x or between, and missed by the median of those misses."""
    trials = [(step(1.0), 1.0, 1), (step(2.0), 2.4, 1), (step(3.0), 3.0, 1), (step(4.0), 4.8, 1)]
    fix = Correction.of(trials)
    missed = []
    for i, (t, measured, n) in enumerate(trials):
        others = Correction.of(trials[:i] + trials[i + 1:])
        missed.append(abs(others.apply(t, n).seconds / measured - 1))
    assert fix.error == pytest.approx(sorted(missed)[1:3][0] / 2 + sorted(missed)[1:3][1] / 2)
    assert 0.05 < fix.error < 0.2
    assert Correction.of(trials[:2]).error is None           # two trials: nothing to leave out


def test_one_trial_or_trials_that_cannot_tell_the_two_apart_give_the_factor_alone():
    assert Correction.of([(step(1.0), 1.3, 2)]) == Correction(1.3, 0.0, 1)
    # the same config twice: the median ratio, whatever the sub-batches
    assert Correction.of([(step(1.0), 1.2, 2), (step(1.0), 1.4, 2)]).per_micro_batch == 0.0
    # a fit that would make the fixed cost negative (the same work in more sub-batches ran faster) is not believed
    fix = Correction.of([(step(1.0), 1.0, 2), (step(1.0), 2.0, 1)])
    assert fix == Correction(1.5, 0.0, 2)
    assert Correction.of([(None, 1.0, 1)]) is None
