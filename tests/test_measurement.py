"""Trials measure like a benchmark tool: intervals that cover at their stated rate, calibrated step counts,
interference observed, unstable rounds measured again."""

import subprocess
import sys
import time

import numpy as np
import pytest

from sltune.profiling import run_trial
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


def _trial(**kw):
    spec = dict(model="llama-tiny", seq_len=32, profile=False, timeout_s=120, steps=2)
    spec.update(kw)
    r = run_trial(spec)
    assert r.status == "ok", r.error
    return r


def test_steps_are_calibrated_to_the_minimum_time_and_every_one_is_kept():
    r = _trial(min_time_s=0.4, max_steps=400, remeasure=0)
    t = r.timing
    assert len(t.steps_s) >= 2 and (sum(t.steps_s) >= 0.4 or len(t.steps_s) == 400)
    assert len(t.steps_s) == 2 or sum(t.steps_s[:-1]) < 0.4     # stopped as soon as the time was reached
    assert t.median_s == pytest.approx(float(np.median(t.steps_s))) and r.step_seconds == t.median_s
    tokens = 32                                 # b=1, N=1, seq_len 32
    assert r.tokens_per_s == pytest.approx(float(np.median([tokens / s for s in t.steps_s])))
    lo, hi = t.tokens_per_s_ci95
    assert lo <= r.tokens_per_s <= hi
    capped = _trial(min_time_s=60, max_steps=5, remeasure=0)
    assert len(capped.timing.steps_s) == 5


def test_cpu_threads_is_what_the_trial_uses():
    r = _trial(cpu_threads=1, min_time_s=0.2, remeasure=0)
    assert r.timing.interference.threads == 1
    # one thread cannot use much more than one core's time
    assert r.timing.interference.process_cpu_s <= 1.3 * r.timing.interference.wall_s


def test_a_round_beside_busy_processes_is_unstable_and_measured_again():
    hogs = [subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<30: pass"])
            for _ in range(2)]
    try:
        time.sleep(0.3)
        r = _trial(cpu_threads=2, min_time_s=0.5, remeasure=1)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    t = r.timing
    assert t.interference.others_busy_cores > 0.5, t.interference
    assert t.unstable and t.rounds == 2
    assert any("other processes" in why for why in t.unstable_reasons), t.unstable_reasons
