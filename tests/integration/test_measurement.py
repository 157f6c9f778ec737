"""Trials measure like a benchmark tool: intervals that cover at their stated rate, calibrated step counts,
interference observed, unstable rounds measured again."""

import subprocess
import sys
import time

import numpy as np
import pytest

from sltune.profiling import run_trial


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
