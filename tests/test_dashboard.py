"""The dashboards: the figure builders on realistic data, the pages in-process, and one job's page in a real
headless Chromium against a real server with a real (tiny) tuning job."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import plotly
import pytest
from fastapi.testclient import TestClient

from sltune.dashboards import figures
from sltune.tuning.report.compare import JobData, compare
from sltune.settings import Settings
from sltune.tuning.search.fit import MODELS, LinearFit, variables
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate
from sltune.tuning.cost.admission import load as admitted_spec
from tests.conftest import TOKEN, Proc, free_port, tiny_spec

MIB = 1024 * 1024
DEVICE_LIMIT, HOST_LIMIT = 6 * MIB, 8 * 1024 * MIB
SPEC = {"model": {"preset": "llama-tiny"}, "workload": {"seq_len": 64}}     # the job ROWS come from

# (number, role, status, b, N, k, tokens/s, device peak, host peak, (compute, memcpy, cpu, other)) as a real
# job of examples/tiny-llama-cpu.yaml measured them
ROWS = [
    (0, "probe", "ok", 1, 1, 1, 74.2, 1064452, 322760704, (0.710, 0.138, 0.085, 0.067)),
    (1, "probe", "ok", 1, 1, 4, 97.6, 3107332, 324595712, (0.843, 0.048, 0.101, 0.008)),
    (2, "probe", "ok", 4, 1, 1, 372.2, 2568196, 326525952, (0.811, 0.077, 0.073, 0.039)),
    (3, "probe", "oom", 4, 1, 4, None, 6323716, None, None),
    (4, "probe", "ok", 1, 4, 1, 218.8, 1172496, 323485696, (0.725, 0.087, 0.126, 0.062)),
    (5, "probe", "ok", 1, 4, 4, 168.7, 3215376, 325681152, (0.959, 0.010, 0.021, 0.010)),
    (6, "probe", "ok", 2, 1, 2, 198.0, 2778628, 325582848, (0.495, 0.093, 0.385, 0.027)),
    (7, "frontier", "ok", 4, 8, 2, 261.9, 5090336, 332496896, (0.847, 0.037, 0.106, 0.010)),
    (8, "frontier", "ok", 8, 8, 1, 1618.8, 5813792, 340676608, (0.876, 0.020, 0.091, 0.013)),
]


def _result(status, b, n, k, tps, dev, host, bd, seq_len=64):
    out = {"status": status, "error": None if status == "ok" else "device memory limit exceeded on cpu",
           "config": {"sub_batch_size": b, "num_sub_batches": n, "num_live_blocks": k, "schedule": "speedloader",
                      "seq_len": seq_len, "world_size": 1},
           "tokens_per_s": tps, "step_seconds": b * n * seq_len / tps if tps else None,
           "peak_device_bytes": dev, "peak_host_bytes": host, "breakdown": None}
    if bd is not None:
        compute, memcpy, cpu, other = bd
        out["breakdown"] = {"compute": compute, "memcpy": memcpy, "cpu": cpu, "all_gather": 0.0,
                            "reduce_scatter": 0.0, "other": other}
    return out


def realistic_trials(start: datetime | None = None) -> list[dict]:
    """Trials as GET /jobs/{id}/trials gives them."""
    t0 = start or datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    out = []
    for i, (num, role, status, b, n, k, tps, dev, host, bd) in enumerate(ROWS):
        out.append({"number": num, "role": role, "status": status,
                    "config": {"sub_batch_size": b, "num_sub_batches": n, "num_live_blocks": k,
                               "schedule": "speedloader"},
                    "predicted": ({"peak_device_bytes": dev * 1.08, "peak_host_bytes": None}
                                  if role == "frontier" else {}),
                    "result": _result(status, b, n, k, tps, dev, host, bd),
                    "started_at": t0 + timedelta(seconds=10 * i), "finished_at": t0 + timedelta(seconds=10 * i + 7),
                    "trace_url": f"/jobs/j/trials/{num}/trace" if status == "ok" else None})
    return out


def realistic_models(trials: list[dict]) -> dict:
    """The job's fitted models, fitted by sltune's own least squares on the ok trials."""
    out = {}
    for kind, (target, feats) in MODELS["train"].items():
        rows = []
        for t in trials:
            r = t["result"]
            if t["status"] != "ok" or r.get(target) is None:
                continue
            rows.append((variables(Candidate.from_knobs(t["config"]), shape_of("llama-tiny"), 64), float(r[target])))
        out[kind] = LinearFit.fit(target, feats, rows).to_dict()
    return out


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
    star = [tr for tr in fig.data if tr.marker.symbol is not None and "star" in list(tr.marker.symbol or [])]
    assert len(star) == 1


def test_peaks_figure_draws_measured_against_predicted_with_both_limits():
    trials = realistic_trials()
    models = realistic_models(trials)
    fig = figures.peaks_figure(models, trials, {"device": DEVICE_LIMIT, "host": HOST_LIMIT}, SPEC)
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


def test_partial_and_missing_data_give_no_figure_instead_of_an_error():
    running = [{"number": 0, "role": "probe", "status": "running", "config": {"sub_batch_size": 1},
                "result": None, "started_at": datetime.now(timezone.utc), "finished_at": None}]
    odd = [{"status": "ok"}, {"status": "ok", "result": {"breakdown": {"compute": 0}}}, {}]
    for trials in ([], running, odd):
        assert figures.breakdown_pies(trials) is None
        assert figures.throughput_figure(trials) is None
        assert figures.peaks_figure(None, trials, {}) is None
    assert figures.timeline_figure([]) is None
    assert figures.timeline_figure(running) is not None
    assert figures.compare_figure({"rows": []}) is None
    failed = [t for t in realistic_trials() if t["status"] == "oom"]
    assert figures.throughput_figure(failed) is not None          # the oom cross, on its own
    assert figures.peaks_figure({}, failed, {"device": DEVICE_LIMIT}) is None   # no model: nothing to compare


# -- pages, in-process --------------------------------------------------------------------------------
XSS = '<script>alert("x")</script>'


def _spec(name):
    return admitted_spec({**tiny_spec(name), "hardware": {"device_memory_limit": "6MiB",
                                                          "host_memory_limit": "8GiB"}})


def _job(store, name, status, trials, scale=1.0, result=True):
    spec = _spec(name)
    job = store.create_job(name, spec.model_dump(mode="json"), spec.digest(), {}, status="running")
    for t in trials:
        store.start_trial(job.id, t["number"], t["role"], t["config"], t["predicted"], None, None)
        if t["status"] != "running":
            r = dict(t["result"])
            if r.get("tokens_per_s"):
                r["tokens_per_s"] *= scale
            store.finish_trial(job.id, t["number"], r)
            if t["status"] == "ok":
                store.add_artifact(job.id, t["number"], "trace", f"{job.id}/trial-{t['number']}.json", 10)
    done = [t for t in trials if t["status"] == "ok"]
    best = max(done, key=lambda t: t["result"]["tokens_per_s"]) if done else None
    res = None
    if result:
        res = {"job_id": job.id, "name": name, "strategy": "oneshot", "stop_reason": "max_trials reached",
               "best": None, "predicted": None, "binding_limit": None, "models": realistic_models(trials),
               "margins": {"device": 0.05, "host": 0.05}, "trials": []}
        if best is not None and status == "succeeded":
            r = best["result"]
            res["best"] = {"trial_number": best["number"], "config": {**best["config"]},
                           "tokens_per_s": r["tokens_per_s"] * scale, "step_seconds": r["step_seconds"],
                           "peak_device_bytes": r["peak_device_bytes"], "peak_host_bytes": r["peak_host_bytes"]}
            res["predicted"] = {"peak_device_bytes": 5.7e6, "peak_host_bytes": 3.4e8, "step_seconds": 2.6,
                                "tokens_per_s": 1500.0, "fits": True, "over": []}
            res["binding_limit"] = "device"
    store.update_progress(job.id, {"trials_done": len(done), "max_trials": 12, "phase": "frontier",
                                   "best_tokens_per_s": best["result"]["tokens_per_s"] if best else None,
                                   "best_config": best["config"] if best else None})
    if status == "running":
        for kind, fit in realistic_models(trials).items():
            store.save_fit(job.id, kind, fit["n"], fit)
        store.set_status(job.id, "running")
    else:
        store.set_status(job.id, status, result=res, error="no config ran successfully" if status == "failed" else None)
    return job.id


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from sltune.api.app import create_app

    tmp = tmp_path_factory.mktemp("site")
    app = create_app(Settings(data_dir=tmp / "data", db=f"sqlite:///{tmp / 'jobs.db'}"))
    store = app.state.store
    trials = realistic_trials()
    ids = {
        "done": _job(store, "tiny-llama-cpu", "succeeded", trials),
        "slower": _job(store, "tiny-llama-cpu-slower", "succeeded", trials, scale=0.8),
        "running": _job(store, XSS, "running", trials[:3] + [{**trials[3], "status": "running"}], result=False),
        "failed": _job(store, "all-oom", "failed", [t for t in trials if t["status"] == "oom"]),
    }
    spec = _spec("waiting")
    ids["queued"] = store.create_job("waiting", spec.model_dump(mode="json"), spec.digest(), {"device": "cpu"}).id
    with TestClient(app) as client:
        yield client, ids


def _no_cdn(text: str) -> None:
    assert "cdn" not in text.lower()
    assert f'<script src="/dashboard/static/plotly.min.js?v={plotly.__version__}"></script>' in text or \
        "plotly-graph-div" not in text


def test_job_list_shows_every_job_with_status_progress_best_and_links(site):
    client, ids = site
    r = client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for job_id in ids.values():
        assert f"/dashboard/jobs/{job_id}" in r.text
    assert f"/jobs/{ids['done']}/config.yaml" in r.text and f"/jobs/{ids['failed']}/config.yaml" not in r.text
    assert "1,618.8" in r.text and "s-succeeded" in r.text and "s-queued" in r.text and "<progress" in r.text
    # a finished job that stopped before max_trials (12) has a full bar; a running one counts to its max
    done_row = r.text.split(f"/dashboard/jobs/{ids['done']}'>")[1].split("</tr>")[0]
    assert '<progress max="8" value="8">' in done_row and "8 search + 0 confirm" in done_row
    running_row = r.text.split(f"/dashboard/jobs/{ids['running']}'>")[1].split("</tr>")[0]
    assert '<progress max="12" value="3">' in running_row and "3/12 search" in running_row
    assert XSS not in r.text and html_escaped(XSS) in r.text
    assert 'http-equiv="refresh"' in r.text            # a job is still running
    _no_cdn(r.text)
    assert ids["failed"] in client.get("/dashboard?status=failed").text
    assert ids["done"] not in client.get("/dashboard?status=failed").text


def html_escaped(s: str) -> str:
    import html

    return html.escape(s)


def test_job_page_has_every_section_and_the_links(site):
    client, ids = site
    r = client.get(f"/dashboard/jobs/{ids['done']}")
    assert r.status_code == 200
    text = r.text
    # history, parallel coordinates, throughput, peaks, pies, seconds, timeline; importance needs the job's
    # Optuna study, which these hand-made jobs lack (the browser test's real job has it)
    assert text.count('class="plotly-graph-div"') == 7
    for heading in ("Best config", "History", "Parameter importance", "Parallel coordinates",
                    "Throughput against the knobs", "Measured peaks against the fitted models",
                    "Time breakdown per trial", "Seconds per trial", "Trial timeline", "Trials"):
        assert f">{heading}</h2>" in text
    assert "Not enough successful trials with different knobs to say yet." in text
    assert "<table id='trials'>" in text and "sltuneSort(this)" in text and "oninput='sltuneFilter(this)'" in text
    assert "8 search + 0 confirm trials, finished" in text and "s left" not in text   # finished: no time left
    assert f"href='/jobs/{ids['done']}/config.yaml'" in text
    for n in (0, 1, 2, 4, 5, 6, 7, 8):
        assert f"/jobs/{ids['done']}/trials/{n}/trace" in text
    assert f"/jobs/{ids['done']}/trials/3/trace" not in text           # the oom trial has no trace
    assert "Perfetto" in text and "device memory limit exceeded" in text
    assert 'http-equiv="refresh"' not in text
    _no_cdn(text)


def test_running_failed_and_queued_jobs_show_what_they_have(site):
    client, ids = site
    r = client.get(f"/dashboard/jobs/{ids['running']}")
    assert r.status_code == 200 and XSS not in r.text and html_escaped(XSS) in r.text
    assert "Best so far" in r.text and "config.yaml'" not in r.text and 'http-equiv="refresh"' in r.text
    assert r.text.count('class="plotly-graph-div"') == 7           # the models come from the fits table
    assert "s-running" in r.text
    r = client.get(f"/dashboard/jobs/{ids['failed']}")
    assert r.status_code == 200 and "no config ran successfully" in r.text
    assert "No ok trial with a time breakdown yet" in r.text and "oom" in r.text
    r = client.get(f"/dashboard/jobs/{ids['queued']}")
    assert r.status_code == 200 and "No trials yet" in r.text and "waiting for" in r.text
    assert r.text.count('class="plotly-graph-div"') == 0
    for page in (f"/dashboard/jobs/{ids[k]}" for k in ids):
        _no_cdn(client.get(page).text)


def test_unknown_job_is_a_404_page(site):
    client, _ = site
    r = client.get("/dashboard/jobs/" + "nope%3Cb%3E")
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "<b>" not in r.text.split("<main>")[1] and "Not found" in r.text
    assert client.get("/dashboard/compare?a=nope&b=nope").status_code == 404


def test_user_text_is_escaped_on_every_page(site):
    """The templates autoescape: a job name or a query value with markup shows as text on every page that prints
    it (headings, tables, the compare form's options, the 400 page); only Plotly's figure divs go in raw."""
    client, ids = site
    for path, params in [("/dashboard", {}), ("/dashboard", {"status": XSS}),
                         (f"/dashboard/jobs/{ids['running']}", {}),
                         ("/dashboard/compare", {}),
                         ("/dashboard/compare", {"a": ids["running"], "b": ids["done"]}),
                         ("/dashboard/compare", {"a": ids["done"], "b": ids["running"], "max_regression": XSS})]:
        r = client.get(path, params=params)
        assert r.status_code in (200, 400), (path, params, r.status_code)
        assert XSS not in r.text and html_escaped(XSS) in r.text, (path, params)


def test_every_template_ships_as_package_data():
    """pip install . (not editable) carries dashboards/templates/ only where pyproject's package data names it."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[1]
    conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    names = [p.relative_to(root / "dashboards").as_posix() for p in (root / "dashboards" / "templates").rglob("*")
             if p.is_file()]
    assert "templates/base.html" in names
    assert all(any(fnmatch.fnmatch(n, g) for g in conf["sltune.dashboards"]) for n in names), names


def test_compare_page_shows_both_jobs_side_by_side_and_the_ci_verdict(site):
    client, ids = site
    r = client.get("/dashboard/compare", params={"a": ids["done"], "b": ids["slower"]})
    assert r.status_code == 200 and r.text.count('class="plotly-graph-div"') == 1
    assert "REGRESSION" in r.text and "20.0%" in r.text
    assert "1,618.8" in r.text and "1,295.0" in r.text
    _no_cdn(r.text)
    r = client.get("/dashboard/compare", params={"a": ids["slower"], "b": ids["done"]})
    assert "REGRESSION" not in r.text and ">faster<" in r.text
    r = client.get("/dashboard/compare", params={"a": ids["done"], "b": ids["slower"], "max_regression": "25%"})
    assert "REGRESSION" not in r.text
    r = client.get("/dashboard/compare", params={"a": ids["done"], "b": ids["failed"]})
    assert r.status_code == 200 and "nothing to compare" in r.text
    r = client.get("/dashboard/compare")
    assert r.status_code == 200 and "<form" in r.text and ids["done"] in r.text
    assert client.get("/dashboard/compare", params={"a": ids["done"], "b": ids["done"],
                                                    "max_regression": "lots"}).status_code == 400


def test_plotly_js_is_served_by_the_app_with_caching_headers(site):
    client, _ = site
    bundled = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    r = client.get("/dashboard/static/plotly.min.js")
    assert r.status_code == 200 and "javascript" in r.headers["content-type"]
    assert r.headers["content-encoding"] == "gzip" and r.content == bundled     # httpx decodes it
    assert "max-age=" in r.headers["cache-control"] and r.headers["etag"]
    plain = client.get("/dashboard/static/plotly.min.js", headers={"accept-encoding": "identity"})
    assert plain.content == bundled and "content-encoding" not in plain.headers
    again = client.get("/dashboard/static/plotly.min.js", headers={"if-none-match": r.headers["etag"]})
    assert again.status_code == 304


# -- one job, one best figure (issue #23) ----------------------------------------------------------
def test_the_post_tune_example_is_the_readme_spec_and_the_server_accepts_it(site):
    """Swagger's and ReDoc's example body was made up from the schema (preset "string", sub_batch_size 0) and
    refused; it is the README's spec now (examples/tiny-llama-cpu.yaml, which the README shows), and "Try it out"
    queues a job."""
    import yaml

    client, _ = site
    spec = (Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-cpu.yaml").read_text()
    body = client.get("/openapi.json").json()["paths"]["/tune"]["post"]["requestBody"]["content"]
    example = body["application/json"]["example"]
    assert example == yaml.safe_load(spec)
    r = client.post("/tune", json=example)
    assert r.status_code == 202, r.text


def test_one_job_reports_one_best_figure_everywhere(site, monkeypatch, tmp_path, capsys):
    """Issue #23: the pick's search trial said one figure, its confirmation trials (the machine got faster
    mid-job) others, and each surface quoted a different one. Here the confirmation measures the pick 1.5x
    its search trial, by construction, and every surface shows the one figure: the median of every step of
    all the pick's trials, search and confirm. The Optuna study holds the confirmation trials and names the
    pick."""
    import io
    import json
    from statistics import median

    import optuna
    import yaml

    import sltune.tuning.runner as runner
    from sltune.cli.main import main
    from sltune.cli.progress import JobBar
    from sltune.cli.tune import describe
    from sltune.service.local import tune
    from sltune.store.optuna import optuna_location
    from tests.fake_trials import FakeTrials

    client, _ = site
    store = client.app.state.store
    monkeypatch.setattr(runner, "run_trial", FakeTrials({1: 1900.0, 2: 2000.0}, later=(1.5,)))
    spec = {**tiny_spec("one-truth"), "search": {**tiny_spec()["search"], "strategy": "grid", "sub_batch_size": [1, 2],
                                                 "num_sub_batches": [1], "num_live_blocks": [1], "max_trials": 2,
                                                 "confirm_rounds": 2}}
    calls = []
    r = tune(spec, store.url, progress=calls.append, settings=Settings(data_dir=tmp_path))
    assert r["status"] == "succeeded", r
    best = r["best"]
    job_id, pick = r["job_id"], best["config"]["sub_batch_size"]
    rows = [t for t in store.trials(job_id) if t.config["sub_batch_size"] == pick]
    search = [t for t in rows if t.role != "confirm"]
    confirms = [t for t in rows if t.role == "confirm"]
    assert len(search) == 1 and len(confirms) == 2
    assert all(t.tokens_per_s > 1.4 * search[0].tokens_per_s for t in confirms)    # measured differently
    steps = [t.result["timing"]["tokens_per_step"] / s for t in rows for s in t.result["timing"]["steps_s"]]
    figure = median(steps)
    assert best["tokens_per_s"] == figure and best["from_trials"] == sorted(t.number for t in rows)
    assert figure not in {t.tokens_per_s for t in rows}       # no one trial's figure: all of them pooled
    lo, hi = best["tokens_per_s_ci95"]
    assert lo < figure < hi
    shown = f"{figure:,.1f}"

    # the API, its job list and best.yaml
    assert client.get(f"/jobs/{job_id}").json()["best"]["tokens_per_s"] == figure
    assert next(j for j in client.get("/jobs").json() if j["id"] == job_id)["best"]["tokens_per_s"] == figure
    measured = yaml.safe_load(client.get(f"/jobs/{job_id}/config.yaml").text)["measured"]
    assert measured["tokens_per_s"] == figure and measured["tokens_per_s_ci95"] == [lo, hi]
    # the job list and the job page (with counts that tell search and confirm trials apart)
    row = client.get("/dashboard").text.split(f"/dashboard/jobs/{job_id}'>")[1].split("</tr>")[0]
    assert shown in row and "2 search + 4 confirm" in row
    page = client.get(f"/dashboard/jobs/{job_id}").text
    section = page.split(">Best config</h2>")[1].split("<h2")[0]
    assert f"<th>tokens/s</th><td class='num'>{shown}</td>" in section                  # measured (then predicted)
    assert "1 search + 2 confirm" in section and "2 search + 4 confirm trials, finished" in page
    # the compare page and `sltune compare` (the job against itself: both sides are its best)
    cmp_page = client.get("/dashboard/compare", params={"a": job_id, "b": job_id}).text
    assert cmp_page.split("</table>")[0].count(f"<td class='num'>{shown}</td>") == 2
    for args in (["--json"], []):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["compare", job_id, job_id, "--db", store.url, *args]) == 0
        if args:
            assert json.loads(out.getvalue())["best_a"] == figure
        else:
            assert f"best: {shown} -> {shown} tokens/s" in out.getvalue()
    # the CLI: `tune`'s text and its bar's last frame, from the last progress report
    assert f"best: b={pick} N=1 k=1 (speedloader): {shown} [" in describe(r)
    assert calls[-1]["best_tokens_per_s"] == figure and calls[-1]["phase"] == "finished"
    capsys.readouterr()
    bar = JobBar("tune one-truth", 2)
    bar.show(calls[-1])
    bar.close()
    frame = capsys.readouterr().err.strip().split("\r")[-1]
    assert f"best={shown} tok/s" in frame and "2 search + 4 confirm" in frame and "6/6" in frame, frame

    # Optuna's own API: every trial, confirmation ones with their role, and the pick as the study's attributes
    study = optuna.load_study(study_name=f"sltune-{job_id}", storage=optuna_location(store.url)[0])
    by_number = {t.user_attrs["sltune_trial"]: t for t in study.trials}
    assert sorted(by_number) == sorted(t.number for t in store.trials(job_id))
    for t in store.trials(job_id):
        assert by_number[t.number].user_attrs["role"] == t.role and by_number[t.number].value == t.tokens_per_s
    attrs = study.user_attrs
    assert attrs["pick"] == best["config"] and attrs["pick_tokens_per_s"] == figure
    assert attrs["pick_tokens_per_s_ci95"] == [lo, hi] and attrs["pick_trials"] == best["from_trials"]
    assert sorted(attrs["pick_optuna_trials"]) == sorted(by_number[n].number for n in best["from_trials"])
    assert attrs["pick_confidence"] == r["confidence"]
    # Optuna's best_trial is one trial, here a confirmation trial of a faster round: not the pick's figure
    assert study.best_trial.value > figure and study.best_trial.user_attrs["role"] == "confirm"


# -- a real browser against a real server ------------------------------------------------------------
def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


def run_chromium(binary: str, profile: Path, *args: str, timeout: float = 90) -> str:
    """Headless Chromium with no network beyond the loopback server: no sync, updates or first-run."""
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
           "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--disable-extensions", "--hide-scrollbars",
           "--mute-audio", f"--user-data-dir={profile}", "--virtual-time-budget=15000", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "HOME": str(profile)})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_job_page_renders_its_plots_in_headless_chromium(tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium binary: install chromium (apt-get install -y chromium) to run the browser test")
    from sltune.service.local import tune

    db, data = f"sqlite:///{tmp_path / 'jobs.db'}", tmp_path / "data"
    port = free_port()
    env = {**os.environ, "SLTUNE_API_TOKEN": TOKEN, "SLTUNE_DATA_DIR": str(data)}
    server = Proc(["serve", "--port", str(port), "--no-worker", "--db", db], env, tmp_path / "serve.log")
    try:
        # the job runs here while the server starts; the server only reads the same database
        out = tune(tiny_spec("browser-check", trials=4, profile=True), db=db, settings=Settings(data_dir=data))
        assert out["status"] == "succeeded", out
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up:\n" + server.output()
            time.sleep(0.2)
        job_id = out["job_id"]
        trials = httpx.get(f"{url}/jobs/{job_id}/trials").json()
        ok = [t for t in trials if t["status"] == "ok" and (t["result"] or {}).get("breakdown")]
        assert ok and httpx.get(url + ok[0]["trace_url"]).status_code == 200

        page = f"{url}/dashboard/jobs/{job_id}"
        dom = run_chromium(binary, tmp_path / "chromium", "--dump-dom", page)
        plots = dom.count("js-plotly-plot")            # the class plotly.js adds once it has drawn a figure
        pielayers = dom.count('class="pielayer"')
        slices = len(re.findall(r'<g class="slice"', dom))
        points = len(re.findall(r'<path class="point"', dom))
        bars = len(re.findall(r'<g class="point"', dom))
        print(f"\nDOM of {page}: {plots} .js-plotly-plot, {pielayers} .pielayer, "
              f"{slices} g.slice, {points} scatter points, {bars} bars")
        importance = httpx.get(page).text.count('class="plotly-graph-div"') == 8
        # history, importance, parallel coordinates, throughput, peaks, breakdown pies, seconds, timeline
        assert plots == 8 and importance, dom[-3000:]
        assert dom.count('class="parcoords"') == 1                    # parallel coordinates drawn
        assert dom.count('class="updatemenu-button"') >= 6            # log-y toggles: history, throughput, seconds
        assert slices >= 4 * min(len(ok), figures.PIE_LIMIT)          # compute, memcpy, CPU, other at least
        assert "all-gather" not in dom.split("Time breakdown per trial")[1]   # one rank: no empty slices
        assert points >= len(ok) and bars >= len(trials) + len(ok)    # timeline bars, stacked seconds
        assert "<table id=\"trials\">" in dom and dom.count("sltuneSort(this)") == 12   # a sortable heading per column
        assert "browser-check" in dom and f"/jobs/{job_id}/config.yaml" in dom

        # the table sorts and filters in the browser: ok trials with b=2, by tokens/s
        view = run_chromium(binary, tmp_path / "chromium", "--dump-dom", f"{page}?filter=ok+b%3D2&sort=tokens/s")
        body = view.split('<table id="trials">')[1].split("</table>")[0]
        rows = re.findall(r"<tr( hidden=\"\")?>(.*?)</tr>", body.split("<tbody>")[1])
        shown = [re.findall(r"<td class=\"num\" data-v=\"([^\"]*)\"", cells)[0] for hidden, cells in rows if not hidden]
        expect = sorted(t["result"]["tokens_per_s"] for t in ok if t["config"]["sub_batch_size"] == 2)
        assert expect and [float(v) for v in shown] == expect and len(rows) == len(trials)
        assert f">{len(expect)}</span> of {len(trials)} trials" in view

        shot = tmp_path / "dashboard-job.png"
        run_chromium(binary, tmp_path / "chromium", f"--screenshot={shot}", "--window-size=1400,4800", page)
        width, height = png_size(shot)
        assert (width, height) == (1400, 4800) and shot.stat().st_size > 50_000
        print(f"screenshot of the job page: {shot}")
        keep = os.environ.get("SLTUNE_SCREENSHOT_DIR")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(keep) / shot.name)
    finally:
        server.kill(signal.SIGTERM)


MEASURE_JS = """<script>
setTimeout(() => {
  const box = el => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const out = [...document.querySelectorAll(".js-plotly-plot")].map(div => ({
    modebar: [...div.querySelectorAll(".modebar")].map(box),
    buttons: [...div.querySelectorAll(".updatemenu-button")].map(box),
    titles: [...div.querySelectorAll(".annotation")].map(box)}));
  const pre = document.createElement("pre"); pre.id = "geometry"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 1000);
</script>"""


@pytest.mark.slow
def test_the_log_y_buttons_stay_clear_of_plotlys_mode_bar_in_a_browser(tmp_path):
    """Issue #23: the "linear y / log y" buttons sat under Plotly's mode bar. Every figure that has them is
    drawn as the job page draws it, in headless Chromium, and the boxes the browser laid out must not meet
    (neither the mode bar nor the subplot titles)."""
    import json

    from sltune.dashboards.pages import _fig_html

    binary = chromium()
    if binary is None:
        pytest.skip("no chromium binary: install chromium (apt-get install -y chromium) to run the browser test")
    trials = realistic_trials()
    figs = [figures.history_figure(trials), figures.throughput_figure(trials, 8), figures.seconds_figure(trials)]
    js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    page = tmp_path / "figures.html"
    page.write_text(f'<!doctype html><html><head><meta charset="utf-8"><script src="{js.as_uri()}"></script></head>'
                    f'<body><main style="max-width:1400px">{"".join(_fig_html(f, "") for f in figs)}</main>'
                    f"{MEASURE_JS}</body></html>")
    dom = run_chromium(binary, tmp_path / "chromium", "--window-size=1000,1600", "--dump-dom", page.as_uri())
    drawn = json.loads(re.search(r'<pre id="geometry">(.*?)</pre>', dom).group(1))
    assert len(drawn) == 3

    def meet(a, b) -> bool:
        return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]

    for fig in drawn:
        assert len(fig["buttons"]) == 2 and len(fig["modebar"]) == 1, fig
        for button in fig["buttons"]:
            assert not any(meet(button, other) for other in fig["modebar"] + fig["titles"]), fig
