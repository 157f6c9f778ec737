"""The trial page's figures (sltune.dashboards.trial_figures): its timed steps with their median and interval, its
pick's pooled figure, its breakdown."""

from __future__ import annotations

import pytest

from sltune.dashboards import figures, trial_figures
from tests.support.dashboard_data import measured_job


def test_a_trials_steps_are_drawn_with_its_median_its_interval_and_its_picks_figure():
    job = measured_job()
    trials, picks = job["trials"], figures.picks_of(job["result"])
    t = trials[2]                           # DeepSpeed's pick, pooled with its confirmation #9
    timing = t["result"]["timing"]
    fig = trial_figures.steps_figure(t, picks)
    by_name = {tr.name: tr for tr in fig.data}
    steps = by_name["timed step"]
    assert list(steps.y) == pytest.approx([timing["tokens_per_step"] / s for s in timing["steps_s"]])
    assert list(by_name["the trial's figure (median step)"].y) == [t["result"]["tokens_per_s"]] * 2
    pooled = job["result"]["best"]["tokens_per_s"]
    assert list(by_name["the pick's figure (pooled over trials #2, #9)"].y) == [pooled] * 2
    band = fig.layout.shapes[0]
    assert (band.y0, band.y1) == tuple(timing["tokens_per_s_ci95"])
    # a pick of one trial has no second line; a trial that ran out of memory has no steps
    assert [tr.name for tr in trial_figures.steps_figure(trials[4], picks).data] == [
        "timed step", "the trial's figure (median step)"]
    assert trial_figures.steps_figure(trials[5], picks) is None and trial_figures.breakdown_pie(trials[5]) is None
    pie = trial_figures.breakdown_pie(t).data[0]
    shares = {k: v for k, v in t["result"]["breakdown"].items() if v > 0}
    assert list(pie.values) == list(shares.values()) and pie.meta["trial"] == 2
    assert list(pie.customdata) == [f"{t['result']['breakdown_seconds'][k] * 1000:,.1f} ms" for k in shares]
