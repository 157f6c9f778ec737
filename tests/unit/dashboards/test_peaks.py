"""The peaks figure (sltune.dashboards.peaks): measured peaks against the fit's and the prior's predictions, with
both limits."""

from __future__ import annotations

import pytest

from sltune.dashboards import peaks
from tests.support.dashboard_data import DEVICE_LIMIT, HOST_LIMIT, MIB, realistic_models, realistic_trials

SPEC = {"model": {"preset": "llama-tiny"}, "workload": {"seq_len": 64}}     # the job ROWS come from


def test_peaks_figure_draws_measured_against_predicted_with_both_limits():
    trials = realistic_trials()
    models = realistic_models(trials)
    fig = peaks.peaks_figure(models, trials, {"device": DEVICE_LIMIT, "host": HOST_LIMIT}, SPEC)
    limits = [tr for tr in fig.data if tr.name == "memory limit"]
    assert [tr.y[0] for tr in limits] == [6.0]          # the device limit, near the data: a line
    # the host limit (8 GiB, 25x the largest peak) is a note at the top, not an axis stretched to it
    host_peaks = [t["result"]["peak_host_bytes"] / MIB for t in trials if t["result"]["peak_host_bytes"]]
    note = [a.text for a in fig.layout.annotations if a.text.startswith("host limit")]
    assert note == [f"host limit 8.0 GiB: {HOST_LIMIT / MIB / max(host_peaks):.1f}x the largest measured peak, "
                    "above the plot"]
    assert 10 ** fig.layout.yaxis2.range[1] < 1.3 * max(host_peaks)
    fit = [tr for tr in fig.data if tr.name == "trials the fit used"]
    assert len(fit) == 2 and len(fit[0].x) == 8
    measured = sorted(r["measured"] / MIB for r in models["device"]["residuals"])
    assert sorted(fit[0].y) == pytest.approx(measured)
    oom = [tr for tr in fig.data if tr.name == "other trials (oom)"]   # predicted by the same fit
    assert len(oom) == 1 and oom[0].y[0] == pytest.approx(6323716 / MIB) and oom[0].x[0] > 0
    prior = [tr for tr in fig.data if tr.name == "predicted before the trial ran"]
    assert len(prior) == 1 and len(prior[0].x) == 2
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis2.type == "log"
