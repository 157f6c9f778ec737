"""The dashboards' figure builders (sltune.dashboards.figures) on realistic data."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

from sltune.dashboards import figures, peaks, trial_figures
from sltune.tuning.report.compare import JobData, compare
from tests.support.dashboard_data import DEVICE_LIMIT, backend_trials, measured_job, realistic_trials


# -- figure builders ---------------------------------------------------------------------------------
def test_pies_show_each_ok_trials_breakdown_fastest_first():
    trials = realistic_trials()
    fig = figures.breakdown_pies(trials)
    pies = [tr for tr in fig.data if tr.type == "pie"]
    ok = [t for t in trials if t["status"] == "ok"]
    assert len(pies) == len(ok) == 8
    assert [p.name for p in pies][0] == "trial #8"                   # the fastest first
    by_name = {f"trial #{t['number']}": t for t in ok}
    for p in pies:
        r = by_name[p.name]["result"]
        bd = r["breakdown"]
        # one rank: all-gather and reduce-scatter took no time, and are no slice (nor a legend entry)
        assert list(p.labels) == ["compute", "memcpy", "CPU", "other"]
        assert list(p.values) == [bd[k] for k in ("compute", "memcpy", "cpu", "other")]
        assert math.isclose(sum(p.values), 1.0, abs_tol=1e-9)
        # hover: the seconds behind each percentage, here the fraction of the step time
        assert list(p.customdata) == [f"{bd[k] * r['step_seconds'] * 1000:,.1f} ms"
                                      for k in ("compute", "memcpy", "cpu", "other")]


def test_pies_are_capped_at_the_fastest_twelve():
    base = realistic_trials()[0]
    many = [{**base, "number": i, "result": {**base["result"], "tokens_per_s": 10.0 + i}} for i in range(30)]
    shown, total = figures.pie_trials(many)
    assert total == 30 and len(shown) == 12 and shown[0]["number"] == 29
    assert len(figures.breakdown_pies(many).data) == 12


def test_history_draws_every_trial_in_order_and_the_best_so_far():
    trials = realistic_trials()
    fig = figures.history_figure(trials)
    by_name = {tr.name: tr for tr in fig.data}
    assert list(by_name["search trial"].x) == [0, 1, 2, 4, 5, 6, 7, 8] and list(by_name["oom"].x) == [3]
    best = by_name["best so far (search trials only)"]
    assert list(best.x) == list(range(9))
    assert list(best.y) == [74.2, 97.6, 372.2, 372.2, 372.2, 372.2, 372.2, 372.2, 1618.8]
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == ["linear y", "log y"]


def test_history_draws_confirmation_trials_apart_and_keeps_them_out_of_the_best_so_far():
    """Issue #23: the confirmation round re-measured the pick while the machine ran faster; plotted as search
    trials, they lifted the best-so-far line past anything the search found."""
    trials = realistic_trials()
    last = trials[-1]
    for number, tps in ((9, 2500.0), (10, 400.0), (11, 2400.0)):
        trials.append({**last, "number": number, "role": "confirm",
                       "result": {**last["result"], "tokens_per_s": tps}})
    fig = figures.history_figure(trials)
    by_name = {tr.name: tr for tr in fig.data}
    assert list(by_name["search trial"].x) == [0, 1, 2, 4, 5, 6, 7, 8]
    confirm = by_name["confirmation trial"]
    assert list(confirm.x) == [9, 10, 11] and list(confirm.y) == [2500.0, 400.0, 2400.0]
    assert confirm.marker.symbol != by_name["search trial"].marker.symbol
    best = by_name["best so far (search trials only)"]
    assert list(best.x) == list(range(9)) and max(best.y) == 1618.8


def test_throughput_draws_confirmation_trials_beside_the_search_line_not_on_it():
    """Issue #23: the throughput figure joined a finalist's confirmation trials into its k's dotted line, so the
    line zig-zagged at one b between the rounds' figures."""
    trials = realistic_trials()
    last = trials[-1]
    for number, tps in ((9, 2500.0), (10, 2400.0)):
        trials.append({**last, "number": number, "role": "confirm", "result": {**last["result"], "tokens_per_s": tps}})
    fig = figures.throughput_figure(trials, best_number=8)
    lines = [tr for tr in fig.data if tr.name.startswith("num_live_blocks")]
    assert 2500.0 not in {y for tr in lines for y in tr.y} and 2400.0 not in {y for tr in lines for y in tr.y}
    confirm = [tr for tr in fig.data if tr.name == "confirmation trial"]
    assert len(confirm) == 1 and confirm[0].mode == "markers" and sorted(confirm[0].y) == [2400.0, 2500.0]
    assert set(confirm[0].x) == {last["config"]["sub_batch_size"]}


def test_parallel_coordinates_and_seconds_per_trial_cover_the_ok_trials():
    trials = realistic_trials()
    ok = [t for t in trials if t["status"] == "ok"]
    par = figures.parallel_figure(trials).data[0]
    assert [d.label for d in par.dimensions] == ["sub_batch_size b", "num_sub_batches N", "num_live_blocks k",
                                                 "tokens/s"]
    assert list(par.dimensions[3].values) == [t["result"]["tokens_per_s"] for t in ok]
    assert sorted(par.dimensions[0].ticktext) == ["1", "2", "4", "8"]
    bars = figures.seconds_figure(trials).data
    assert [b.name for b in bars] == ["compute", "memcpy", "CPU", "other"]    # no all-gather at one rank
    for i, t in enumerate(ok):                                                # absolute seconds, stacked
        r = t["result"]
        assert sum(b.y[i] for b in bars) == pytest.approx(r["step_seconds"])
    assert figures.importance_figure({"num_sub_batches": 0.6, "sub_batch_size": 0.3, "num_live_blocks": 0.1}) \
        .data[0].y == ("num_live_blocks", "sub_batch_size", "num_sub_batches")


def test_throughput_figure_facets_by_n_colours_by_k_and_marks_the_oom():
    trials = realistic_trials()
    fig = figures.throughput_figure(trials, best_number=8)
    ok_points = {(x, y) for tr in fig.data if tr.name.startswith("num_live_blocks") for x, y in zip(tr.x, tr.y)}
    assert ok_points == {(t["config"]["sub_batch_size"], t["result"]["tokens_per_s"])
                         for t in trials if t["status"] == "ok"}
    oom = [tr for tr in fig.data if tr.name == "oom"]
    assert len(oom) == 1 and list(oom[0].y) == [0.0] and oom[0].marker.symbol == "x"
    assert {a.text for a in fig.layout.annotations} >= {"num_sub_batches N=1", "num_sub_batches N=4",
                                                        "num_sub_batches N=8"}
    star = [tr for tr in fig.data if tr.name == "the pick"]       # no pick given: at the trial's own figure
    assert len(star) == 1 and star[0].marker.symbol == "star" and list(star[0].y) == [1618.8]
    assert {tr.marker.symbol for tr in fig.data if tr.name.startswith("num_live_blocks")} == {None}   # no star


def test_timeline_has_a_bar_per_started_trial_and_runs_a_running_one_to_now():
    trials = realistic_trials()
    trials.append({"number": 9, "role": "frontier", "status": "running", "config": {}, "result": None,
                   "started_at": trials[-1]["finished_at"], "finished_at": None})
    now = trials[-1]["started_at"] + timedelta(seconds=30)
    fig = figures.timeline_figure(trials, now=now)
    bars = {tr.name: tr for tr in fig.data}
    assert set(bars) == {"ok", "oom", "running"}
    assert sum(len(tr.y) for tr in fig.data) == 10
    assert list(bars["running"].x) == [30_000.0]
    assert list(fig.layout.yaxis.categoryarray)[0] == "#0 probe"


def test_compare_figure_puts_both_jobs_side_by_side():
    a = realistic_trials()
    b = [{**t, "result": {**t["result"], "tokens_per_s": t["result"]["tokens_per_s"] * 0.9}}
         if t["result"]["tokens_per_s"] else t for t in a]
    cmp = compare(JobData("a", "succeeded", {}, None, a), JobData("b", "succeeded", {}, None, b))
    fig = figures.compare_figure(cmp, "A: base", "B: new", max_regression=0.05)
    bars = {tr.name: tr for tr in fig.data}
    assert list(bars["A: base"].y) == [r["a"] for r in cmp["rows"]]
    assert list(bars["B: new"].y) == [r["b"] for r in cmp["rows"]]
    assert all(c == pytest.approx(-0.1) for c in bars["change"].y)
    assert set(bars["change"].marker.color) == {"#d62728"}          # every config dropped more than 5%
    assert fig.layout.barmode == "group"


# -- the backends side by side (issue #33) --------------------------------------------------------------
def test_each_backends_best_is_its_fastest_ok_trial_or_the_job_results_and_never_a_diverged_one():
    trials = backend_trials()
    by_number = {t["number"]: t for t in trials}
    assert figures.backends_in(trials) == ["speedloader", "deepspeed", "fsdp"]
    bests = figures.backend_bests(trials)
    # fsdp's #13 ran 5000 tokens/s, the fastest of all, but diverged: #12 is FSDP's best
    assert {b: t["number"] for b, t in bests.items()} == {"speedloader": 8, "deepspeed": 9, "fsdp": 12}
    result = {"best": {"trial_number": 8, "config": by_number[8]["config"]},
              "best_by_backend": {"deepspeed": {"trial_number": 10, "from_trials": [10]},
                                  "fsdp": {"trial_number": 13, "from_trials": [13]}}}    # not ok: not a best
    bests = figures.backend_bests(trials, result)
    assert {b: t["number"] for b, t in bests.items()} == {"speedloader": 8, "deepspeed": 10, "fsdp": 12}
    # a trial stored before there were backends ran SpeedLoader; one whose result alone names its backend ran that
    assert figures.backend_of(by_number[0]) == "speedloader" and "backend" not in by_number[9]["config"]
    assert figures.backend_of(by_number[9]) == "deepspeed"
    assert figures.config_label(by_number[0]) == "b=1 N=1 k=1"
    assert figures.config_label(by_number[9]) == \
        "deepspeed b=4 N=2 zero_stage=2 offload_optimizer=cpu offload_param=none"


def test_one_pie_per_backend_side_by_side_titled_with_the_backend_and_its_knobs():
    trials = backend_trials()
    fig = figures.backend_pies(trials, figures.backend_bests(trials))
    pies = [tr for tr in fig.data if tr.type == "pie"]
    assert [p.name for p in pies] == ["speedloader", "deepspeed", "fsdp"]
    assert {p.domain.y for p in pies} == {pies[0].domain.y}                     # one row: side by side
    titles = [a.text for a in fig.layout.annotations]
    assert titles[1].startswith("<b>deepspeed</b> · 940.0 tok/s (trial #9)")
    assert "b=4 N=2 zero_stage=2 offload_optimizer=cpu offload_param=none" in titles[1]
    assert "b=8 N=8 k=1" in titles[0] and "cpu_offload=false reshard_after_forward=true" in titles[2]
    # every category each best spent time in: DeepSpeed's collectives are slices, at one rank SpeedLoader has none
    assert list(pies[1].labels) == ["compute", "memcpy", "CPU", "all-gather", "reduce-scatter", "other"]
    assert list(pies[0].labels) == ["compute", "memcpy", "CPU", "other"]
    # a best without a breakdown lends its pie to another trial of its config; a backend with none has no pie
    no_breakdown = [{**t, "result": {**t["result"], "breakdown": None}} if t["number"] == 12 else t for t in trials]
    fig = figures.backend_pies(no_breakdown, figures.backend_bests(no_breakdown))
    assert [p.name for p in fig.data] == ["speedloader", "deepspeed"]


def test_throughput_by_backend_stars_each_best_and_draws_a_diverged_trial_red_not_as_a_throughput():
    trials = backend_trials()
    fig = figures.backend_throughput_figure(trials, figures.backend_bests(trials))
    assert list(fig.layout.xaxis.ticktext) == ["speedloader", "deepspeed", "fsdp"]
    by_name = {tr.name: tr for tr in fig.data}
    ok = [t for t in trials if t["status"] == "ok"]
    assert sorted(by_name["trial"].y) == sorted(t["result"]["tokens_per_s"] for t in ok)
    assert list(by_name["best of its backend"].y) == [1618.8, 940.0, 1130.0]
    diverged = by_name["diverged"]
    assert list(diverged.y) == [0.0] and diverged.marker.color == figures.STATUS_COLORS["diverged"] == "#b00020"
    assert round(diverged.x[0]) == 2 and "by 0.21 (tolerance 0.01); ran 5,000 tokens/s, not counted" in diverged.text[0]
    assert 5000.0 not in {y for tr in fig.data for y in tr.y}                  # never drawn as a throughput
    assert sorted(round(x) for x in by_name["oom"].x) == [0, 1]                 # SpeedLoader's and DeepSpeed's
    # each column's points stay within it
    for tr in fig.data:
        assert all(abs(x - round(x)) <= 0.25 for x in tr.x)


def test_the_speedloader_figures_keep_to_speedloaders_trials():
    """Throughput against the knobs (k is SpeedLoader's) and the peaks against its memory models draw SpeedLoader's
    trials; the seconds per trial, the history and the parallel coordinates every backend's."""
    trials = backend_trials()
    speedloader = [t for t in trials if t["number"] <= 8]
    fig = figures.throughput_figure(trials, best_number=8)
    points = {(x, y) for tr in fig.data if tr.name.startswith("num_live_blocks") for x, y in zip(tr.x, tr.y)}
    assert points == {(t["config"]["sub_batch_size"], t["result"]["tokens_per_s"])
                      for t in speedloader if t["status"] == "ok"}
    assert "diverged" not in {tr.name for tr in fig.data}
    assert len(figures.parallel_figure(trials).data[0].dimensions[-1].values) == 11    # every ok trial
    seconds = figures.seconds_figure(trials)
    assert len(seconds.data[0].x) == 11 and "#9 deepspeed b=4 N=2" in seconds.data[0].x
    history = {tr.name: tr for tr in figures.history_figure(trials).data}
    assert list(history["diverged"].y) == [0.0]


def test_the_compare_figure_gives_each_config_and_backend_a_bar_of_its_own():
    trials = backend_trials()
    cmp = compare(JobData("a", "succeeded", {}, None, realistic_trials()), JobData("b", "succeeded", {}, None, trials))
    fig = figures.compare_figure(cmp, "A", "B")
    ticks = list(fig.data[0].x)
    assert len(ticks) == len(set(ticks)) == 11                  # 8 SpeedLoader configs, 2 DeepSpeed's, 1 FSDP's
    assert ticks[8:] == ["deepspeed b=4 N=2 ZeRO-2 opt:cpu param:none", "deepspeed b=4 N=2 ZeRO-3 opt:cpu param:cpu",
                         "fsdp b=4 N=2 offload:false reshard:true"]
    assert fig.data[0].customdata[10] == "fsdp b=4 N=2 cpu_offload=false reshard_after_forward=true"   # the hover
    assert list(fig.data[0].y[8:]) == [None, None, None] and list(fig.data[1].y[8:]) == [940.0, 610.0, 1130.0]


def test_partial_and_missing_data_give_no_figure_instead_of_an_error():
    running = [{"number": 0, "role": "probe", "status": "running", "config": {"sub_batch_size": 1},
                "result": None, "started_at": datetime.now(timezone.utc), "finished_at": None}]
    odd = [{"status": "ok"}, {"status": "ok", "result": {"breakdown": {"compute": 0}}}, {}]
    for trials in ([], running, odd):
        assert figures.breakdown_pies(trials) is None
        assert figures.backend_pies(trials, figures.backend_bests(trials)) is None
        assert figures.backend_throughput_figure(trials) is None
        assert figures.throughput_figure(trials) is None
        assert peaks.peaks_figure(None, trials, {}) is None
        assert figures.parallel_figure(trials) is None
        figures.history_figure(trials)          # draws what it can (a trial without a number, say), never fails
        assert all(trial_figures.steps_figure(t) is None and trial_figures.breakdown_pie(t) is None for t in trials)
    assert figures.timeline_figure([]) is None
    assert figures.timeline_figure(running) is not None
    assert figures.compare_figure({"rows": []}) is None
    failed = [t for t in realistic_trials() if t["status"] == "oom"]
    assert figures.throughput_figure(failed) is not None          # the oom cross, on its own
    assert peaks.peaks_figure({}, failed, {"device": DEVICE_LIMIT}) is None   # no model: nothing to compare


# -- one figure per pick, the backend marked, a click per trial (issue #46) --------------------------------------
def test_a_pick_is_drawn_at_its_pooled_figure_not_at_one_of_its_trials():
    """Issue #46: the pie's title and the throughput star said the pick's search trial's own figure (DeepSpeed's
    #2 alone ran 6,953 tokens/s) while the Best config table said the pick's: 5,219.0, the median of the steps of
    #2 and its confirmation #9. The pie, the stars and the single-backend pies say the pick's figure."""
    job = measured_job()
    trials, result = job["trials"], job["result"]
    picks = figures.picks_of(result)
    pooled = {b: e["tokens_per_s"] for b, e in result["best_by_backend"].items()}
    assert f"{pooled['deepspeed']:,.1f}" == "5,219.0" and figures.tokens_per_s(trials[2]) > 6900
    assert set(picks) == {2, 9, 7, 10, 4} and picks[9] is picks[2]          # every trial a pick pools
    bests = figures.backend_bests(trials, result)
    assert {b: t["number"] for b, t in bests.items()} == {"speedloader": 7, "deepspeed": 2, "fsdp": 4}

    titles = [a.text for a in figures.backend_pies(trials, bests, picks=picks).layout.annotations]
    assert titles[1].startswith("<b>deepspeed</b> · 5,219.0 tok/s (pooled over trials #2, #9; pie: trial #2)")
    assert titles[0].startswith("<b>speedloader</b> · 3,142.8 tok/s (pooled over trials #7, #10; pie: trial #7)")
    assert titles[2].startswith("<b>fsdp</b> · 1,963.3 tok/s (trial #4)")
    assert not any("6,953" in t for t in titles)

    star = next(tr for tr in figures.backend_throughput_figure(trials, bests, picks).data
                if tr.name == "best of its backend")
    assert list(star.y) == [pooled["speedloader"], pooled["deepspeed"], pooled["fsdp"]]
    assert list(star.text) == ["3,142.8", "5,219.0", "1,963.3"] and "pooled over trials #2, #9" in star.customdata[1]

    star = next(tr for tr in figures.throughput_figure(trials, 7, picks=picks).data if tr.name == "the pick")
    assert list(star.y) == [pooled["speedloader"]] and list(star.x) == [2] and list(star.ids) == ["7"]

    # SpeedLoader's trials alone: its pick's pie is starred and titled with the pick's figure, the others their own
    alone = [t for t in trials if figures.backend_of(t) == "speedloader"]
    titles = [a.text for a in figures.breakdown_pies(alone, picks=picks).layout.annotations]
    assert titles == ["★ #7 b=2 N=1 k=1<br>3,142.8 tok/s, the pick", "#6 b=1 N=1 k=1<br>1,722 tok/s"]


def test_history_and_timeline_mark_each_backend_with_a_legend():
    trials = backend_trials()
    history = figures.history_figure(trials)
    ok = {b: sorted(t["number"] for t in trials if t["status"] == "ok" and figures.backend_of(t) == b)
          for b in ("speedloader", "deepspeed", "fsdp")}
    by_name = {tr.name: tr for tr in history.data}
    for backend, numbers in ok.items():
        tr = by_name[f"{backend} trial"]
        assert sorted(tr.x) == numbers and tr.marker.color == figures.BACKEND_COLORS[backend]
        assert tr.marker.symbol == figures.BACKEND_SYMBOLS[backend] and tr.showlegend
    assert len(set(figures.BACKEND_COLORS.values())) == 3 and len(set(figures.BACKEND_SYMBOLS.values())) == 3
    assert list(by_name["diverged"].x) == [13] and list(by_name["oom"].x) == [3, 11]

    timeline = figures.timeline_figure(trials)
    marks = {tr.name: tr for tr in timeline.data if tr.legendgroup == "backend"}
    assert set(marks) == {"speedloader", "deepspeed", "fsdp"}
    for backend, tr in marks.items():
        assert tr.type == "scatter" and tr.legendgrouptitle.text == "backend"
        assert sorted(int(y.split()[0][1:]) for y in tr.y) == sorted(
            t["number"] for t in trials if figures.backend_of(t) == backend)        # every trial, failed ones too
        assert tr.marker.symbol == figures.BACKEND_SYMBOLS[backend]
    # one backend: as before, nothing to tell apart
    alone = realistic_trials()
    assert {tr.name for tr in figures.history_figure(alone).data} == {"search trial", "oom",
                                                                      "best so far (search trials only)"}
    assert {tr.type for tr in figures.timeline_figure(alone).data} == {"bar"}


def test_the_parallel_coordinates_have_a_backend_axis_and_keep_each_trial_off_other_backends_knobs():
    """Issue #46: DeepSpeed's and FSDP's trials have no k; they were drawn on SpeedLoader's k axis. Each backend's
    own knobs have an axis; another backend's trial crosses it at "n/a", below every value a trial ran."""
    trials = backend_trials()
    ok = [t for t in trials if t["status"] == "ok"]
    par = figures.parallel_figure(trials).data[0]
    dims = {d.label: d for d in par.dimensions}
    assert list(dims) == ["backend", "sub_batch_size b", "num_sub_batches N", "num_live_blocks k", "zero_stage",
                          "offload_optimizer", "offload_param", "cpu_offload", "reshard_after_forward", "tokens/s"]
    assert list(dims["tokens/s"].values) == [figures.tokens_per_s(t) for t in ok]
    backend = dims["backend"]
    assert [backend.ticktext[list(backend.tickvals).index(v)] for v in backend.values] == \
        [figures.backend_of(t) for t in ok]
    for label, owner in (("num_live_blocks k", "speedloader"), ("zero_stage", "deepspeed"),
                         ("cpu_offload", "fsdp")):
        d = dims[label]
        na = d.tickvals[list(d.ticktext).index("n/a")]
        assert na < min(v for v, text in zip(d.tickvals, d.ticktext) if text != "n/a")
        for t, v in zip(ok, d.values):
            assert (v == na) == (figures.backend_of(t) != owner), (label, t["number"])
    k = dims["num_live_blocks k"]
    assert [k.ticktext[list(k.tickvals).index(v)] for v, t in zip(k.values, ok) if figures.backend_of(t) ==
            "speedloader"] == [str(t["config"]["num_live_blocks"]) for t in ok if t["number"] <= 8]
    zero = dims["zero_stage"]
    assert sorted(zero.ticktext[list(zero.tickvals).index(v)] for v, t in zip(zero.values, ok)
                  if figures.backend_of(t) == "deepspeed") == ["2", "3"]
    # a job of SpeedLoader alone: its three knobs, no backend axis and no n/a
    alone = figures.parallel_figure(realistic_trials()).data[0]
    assert [d.label for d in alone.dimensions] == ["sub_batch_size b", "num_sub_batches N", "num_live_blocks k",
                                                   "tokens/s"]
    assert not any("n/a" in (d.ticktext or ()) for d in alone.dimensions)


def test_every_point_of_a_trial_carries_its_number_for_the_click_that_opens_its_page():
    trials = backend_trials()
    bests = figures.backend_bests(trials)
    for fig in (figures.history_figure(trials), figures.backend_throughput_figure(trials, bests)):
        drawn = [tr for tr in fig.data if tr.ids is not None and tr.mode != "lines"]     # the lines: below
        assert sorted(int(i) for tr in drawn if tr.name != "best of its backend" for i in tr.ids) == \
            [t["number"] for t in trials]
    for tr in figures.history_figure(trials).data:         # history: x is the trial's number, the line's steps too
        assert tr.ids is not None and list(tr.ids) == [str(x) for x in tr.x], tr.name
    by_number = {t["number"]: t for t in trials}
    for tr in figures.throughput_figure(trials, 8).data:     # x is the trial's b, y its figure (0: a failed trial)
        assert [(by_number[int(i)]["config"]["sub_batch_size"], figures.tokens_per_s(by_number[int(i)]) or 0.0)
                for i in tr.ids] == list(zip(tr.x, tr.y))
    for tr in figures.timeline_figure(trials).data:
        assert list(tr.ids) == [label.split()[0][1:] for label in tr.y]
    for tr in figures.seconds_figure(trials).data:
        assert list(tr.ids) == [label.split()[0][1:] for label in tr.x]
    pies = figures.breakdown_pies(realistic_trials()).data
    assert [p.meta["trial"] for p in pies] == [int(p.name.split("#")[1]) for p in pies]
