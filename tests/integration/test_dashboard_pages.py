"""The dashboards' pages in-process over a SQLite store: every section, escaping, the compare page, and one
job's best figure the same on every surface."""

from __future__ import annotations

import contextlib
import html
from pathlib import Path

import plotly
import pytest
from fastapi.testclient import TestClient

from sltune.settings import Settings
from sltune.tuning.spec import TuningSpec
from tests.support.dashboard_data import backend_trials, measured_job, realistic_models, realistic_trials
from tests.support.specs import admitted_spec, tiny_spec


# -- pages, in-process --------------------------------------------------------------------------------
XSS = '<script>alert("x")</script>'


def _spec(name):
    return admitted_spec({**tiny_spec(name), "hardware": {"device_memory_limit": "6MiB",
                                                          "host_memory_limit": "8GiB"}})


def _job(store, name, status, trials, scale=1.0, result=True, extra=None):
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
        res.update(extra or {})         # what a newer job result adds (best_by_backend)
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


def _measured(store) -> str:
    """tests.support.dashboard_data.measured_job stored as its job stored it: every trial's config, prediction and
    TrialResult as measured, a trace for each that profiled a step, and the job's result."""
    job = measured_job()
    spec = TuningSpec.parse(job["spec"])      # as a stored job is read: admitted where it ran, not here again
    row = store.create_job(job["name"], spec.model_dump(mode="json"), spec.digest(), {}, status="running")
    for t in job["trials"]:
        store.start_trial(row.id, t["number"], t["role"], t["config"], t["predicted"], None, None)
        store.finish_trial(row.id, t["number"], t["result"])
        if t["result"].get("trace_path"):
            store.add_artifact(row.id, t["number"], "trace", f"{row.id}/trial-{t['number']}.json", 10)
    store.set_status(row.id, "succeeded", result={**job["result"], "job_id": row.id})
    return row.id


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
        # issue #33: one job over SpeedLoader, DeepSpeed and FSDP; the result of one says each backend's best (the
        # DeepSpeed one pooled over its trials: a figure no one trial has), the other's does not
        "backends": _job(store, "three-backends", "succeeded", backend_trials()),
        "backends_named": _job(store, "three-backends-named", "succeeded", backend_trials(), extra={
            "best_by_backend": {"deepspeed": {"trial_number": 10, "from_trials": [10], "tokens_per_s": 655.5,
                                              "config": {"sub_batch_size": 4, "num_sub_batches": 2,
                                                         "backend": "deepspeed", "zero_stage": 3}}}}),
    }
    spec = _spec("waiting")
    ids["queued"] = store.create_job("waiting", spec.model_dump(mode="json"), spec.digest(), {"device": "cpu"}).id
    ids["measured"] = _measured(store)
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
    # one backend: no figure or picker of backends, but the table's backend and parity columns
    assert ">Throughput by backend</h2>" not in text and "<select id='trials-backend'" not in text
    assert "Best per backend" not in text
    assert ">backend</th>" in text and ">parity</th>" in text and text.count("<td>speedloader</td>") == 9
    _no_cdn(text)


def _row(text: str, number: int) -> str:
    """Trial `number`'s row of the trials table (a row is one line of the page)."""
    return next(line for line in text.split("<table id='trials'>")[1].splitlines()
                if line.startswith(f"<tr><td data-v='{number}'>"))


def _section(text: str, heading: str) -> str:
    return text.split(f">{heading}</h2>")[1].split("<h2")[0]


def test_a_job_over_three_backends_shows_them_side_by_side(site):
    """Issue #33: one pie per backend (its best config's breakdown), the throughput of every trial by backend, a
    backend column and picker in the table, each trial's parity; the diverged FSDP trial, the fastest of all, is
    red and never a best. The job result has no best_by_backend here: each backend's best is its fastest ok
    trial."""
    client, ids = site
    text = client.get(f"/dashboard/jobs/{ids['backends']}").text
    # history, parallel coordinates, throughput by backend, throughput against the knobs, peaks, pies, seconds,
    # timeline
    assert text.count('class="plotly-graph-div"') == 8
    assert ">Throughput by backend</h2>" in text and ">Time breakdown per trial</h2>" not in text
    pies = _section(text, "Time breakdown per backend")
    assert pies.count('"hole":0.3') == 3                                # a pie per backend, no more
    assert all(f'"name":"{b}"' in pies for b in ("speedloader", "deepspeed", "fsdp"))
    assert "(trial #8)" in pies and "(trial #9)" in pies and "(trial #12)" in pies and "#13" not in pies
    assert "zero_stage=2 offload_optimizer=cpu offload_param=none" in pies
    by_backend = _section(text, "Throughput by backend")
    assert '"name":"best of its backend"' in by_backend and '"name":"diverged"' in by_backend
    assert '"color":"#b00020"' in by_backend and "5000.0" not in by_backend    # red, on the zero line

    best = _section(text, "Best config").split("<h3>Best per backend</h3>")[1]
    assert [line.split("</td>")[0] for line in best.split("<tr><td>")[1:]] == ["speedloader", "deepspeed", "fsdp"]
    assert "1,130.0" in best and "Trial #12" in best and "5,000" not in best and "#13" not in best
    # the table: a backend column, a picker of the three, the parity per trial
    assert "<option value='deepspeed'>deepspeed</option>" in text and "sltuneBackend(this)" in text
    assert "<td>deepspeed</td>" in _row(text, 9) and "<td>fsdp</td>" in _row(text, 12)
    assert "<td>speedloader</td>" in _row(text, 0)                     # from before there were backends
    assert "b=4 N=2 zero_stage=2 offload_optimizer=cpu offload_param=none" in _row(text, 9)
    assert ">ok</td>" in _row(text, 9) and _row(text, 0).count("data-v=''") >= 1
    diverged = _row(text, 13)
    assert 's-diverged' in diverged and "★" not in diverged and "★" in _row(text, 8)
    assert "(5,000.0)</td>" in diverged and "data-v='0.21'" in diverged and "bad" in diverged
    assert "off: 0.21" in diverged and "tolerance 0.01" in diverged    # the cell, and its title


def test_a_job_results_best_by_backend_is_each_backends_best(site):
    """A job result that says each backend's best (best_by_backend) is shown as it says: the DeepSpeed best is
    trial #10 at its pooled figure, though trial #9 ran faster on its own."""
    client, ids = site
    text = client.get(f"/dashboard/jobs/{ids['backends_named']}").text
    pies = _section(text, "Time breakdown per backend")
    assert pies.count('"hole":0.3') == 3 and "(trial #10)" in pies and "(trial #9)" not in pies
    best = _section(text, "Best config").split("<h3>Best per backend</h3>")[1]
    deepspeed = next(line for line in best.splitlines() if line.startswith("<tr><td>deepspeed</td>"))
    assert "655.5" in deepspeed and "Trial #10" in deepspeed and "zero_stage=3" in deepspeed


def test_the_compare_page_names_each_configs_backend(site):
    """A SpeedLoader-only job against one over three backends: a row per config and backend, DeepSpeed's and
    FSDP's only on B's side (never pooled with SpeedLoader's b and N)."""
    client, ids = site
    text = client.get("/dashboard/compare", params={"a": ids["done"], "b": ids["backends"]}).text
    rows = text.split("<th>backend</th><th>config</th>")[1].split("</table>")[0].split("<tr><td>")[1:]
    by_backend = {}
    for row in rows:
        backend, config = row.split("</td>")[0], row.split("</td><td>")[1].split("</td>")[0]
        by_backend.setdefault(backend, []).append(config)
    assert set(by_backend) == {"speedloader", "deepspeed", "fsdp"} and len(by_backend["speedloader"]) == 8
    assert by_backend["deepspeed"] == ["b=4 N=2 zero_stage=2 offload_optimizer=cpu offload_param=none",
                                       "b=4 N=2 zero_stage=3 offload_optimizer=cpu offload_param=cpu"]
    assert by_backend["fsdp"] == ["b=4 N=2 cpu_offload=false reshard_after_forward=true"]   # not the diverged one
    fsdp = next(row for row in rows if row.startswith("fsdp"))
    assert "<td class='num'>-</td><td class='num'>1,130.0</td>" in fsdp
    summary = text.split("</table>")[0]
    assert summary.count("<td>speedloader</td><td>b=8 N=8 k=1</td>") == 2        # both bests, and their backend


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
    spec = (Path(__file__).resolve().parents[2] / "examples" / "tiny-llama-cpu.yaml").read_text()
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

    import sltune.executors.local as local
    from sltune.cli.main import main
    from sltune.cli.progress import JobBar
    from sltune.cli.tune import describe
    from sltune.service.local import tune
    from sltune.store.optuna import optuna_location
    from tests.support.fake_trials import FakeTrials

    client, _ = site
    store = client.app.state.store
    monkeypatch.setattr(local, "run_trial", FakeTrials({1: 1900.0, 2: 2000.0}, later=(1.5,)))
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


# -- a page per trial, and the job page's links, figures and backends (issue #46) ------------------------------
def _trial(number: int) -> dict:
    return next(t for t in measured_job()["trials"] if t["number"] == number)


def _traces(section: str) -> dict[str, dict]:
    """The traces of the section's figure by name, as the page hands them to Plotly.newPlot."""
    import json

    start = section.index("[", section.index("Plotly.newPlot("))
    return {tr.get("name"): tr for tr in json.JSONDecoder().raw_decode(section[start:])[0]}


@pytest.mark.parametrize("number", [7, 2, 4])       # SpeedLoader's, DeepSpeed's and FSDP's picks
def test_a_trial_page_shows_its_config_figure_predictions_breakdown_operators_parity_and_trace(site, number):
    from sltune.sizes import format_bytes

    client, ids = site
    job_id = ids["measured"]
    t = _trial(number)
    r = t["result"]
    page = client.get(f"/dashboard/jobs/{job_id}/trials/{number}")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    text = page.text
    _no_cdn(text)
    backend = r["config"]["backend"]
    assert f"Trial #{number} <small>of three-backends" in text and f"<dd>{backend}</dd>" in text
    assert f"href='/dashboard/jobs/{job_id}'" in text
    # the config: every knob it ran with
    config = _section(text, "Config")
    for knob, value in {**r["config"], **t["config"]}.items():
        if value is not None:
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            assert f"<tr><th>{knob}</th><td>{shown}</td></tr>" in config, knob
    # the figure with its interval, and every timed step drawn
    lo, hi = r["timing"]["tokens_per_s_ci95"]
    throughput = _section(text, "Throughput")
    assert f"<b>{r['tokens_per_s']:,.1f}</b> tokens/s, 95% interval <b>[{lo:,.1f}, {hi:,.1f}]</b>" in throughput
    assert f"the median of {len(r['timing']['steps_s'])} timed steps" in throughput
    assert throughput.count('class="plotly-graph-div"') == 1 and '"name":"timed step"' in throughput
    # measured beside predicted
    measured = _section(text, "Measured and predicted")
    for label, key in (("device peak", "peak_device_bytes"), ("host peak", "peak_host_bytes")):
        m, p = r[key], t["predicted"][key]
        assert (f"<tr><th>{label}</th><td class='num'>{format_bytes(int(m))}</td>"
                f"<td class='num'>{format_bytes(int(p))}</td><td class='num'>{m / p - 1:+.1%}</td></tr>") in measured
    fits = t["predicted"]["fits"]       # SpeedLoader's b=2 was predicted not to fit its device, and did
    assert ("predicted to fit" if fits else f"predicted not to fit ({', '.join(t['predicted']['over'])})") in measured
    # the pie and the seconds behind it
    breakdown = _section(text, "Time breakdown")
    assert breakdown.count('"hole":0.3') == 1
    for key, share in r["breakdown"].items():
        if share > 0:
            seconds = r["breakdown_seconds"][key] * 1000
            assert f"<td class='num'>{share:.1%}</td><td class='num'>{seconds:,.2f} ms</td>" in breakdown, key
    # the top operators, every one of them with its own time
    ops = _section(text, "Top operators")
    assert len(r["top_ops"]) == 10 and ops.count("<tr><td><code>") == 10
    for op in r["top_ops"]:
        assert f"<code>{op['name']}</code></td><td class='num'>{op['count']}</td>" \
               f"<td class='num'>{op['self_seconds'] * 1000:,.2f} ms</td>" in ops
    # parity
    p = r["parity"]
    parity = _section(text, "Parity")
    assert f"<td class='num'>{p['loss']:.6g}</td><td class='num'>{p['reference_loss']:.6g}</td>" in parity
    assert f">{p['rel_diff']:.2g}</td><td class='num'>{p['tolerance']:.2g}</td><td>ok</td>" in parity
    # the trace, to download
    assert f"<a href='/jobs/{job_id}/trials/{number}/trace' download=" in _section(text, "Trace")
    assert "Perfetto" in _section(text, "Trace")
    assert ">Error</h2>" not in text
    if backend == "deepspeed":
        assert "<dt>optimizer</dt><dd>DeepSpeedCPUAdam</dd>" in text
    # its part in the job's pick, at the pick's figure
    pick = measured_job()["result"]["best_by_backend"][backend]
    assert f"its figure {pick['tokens_per_s']:,.1f} tokens/s" in text


def test_a_failed_trials_page_shows_its_error_and_the_specs_fix(site):
    """FSDP's b=16 trial ran out of device memory: its own error says to lower num_live_blocks, which FSDP does not
    have; the page adds the fix in the spec's terms, FSDP's own knobs. A diverged trial says why it is never picked."""
    client, ids = site
    text = client.get(f"/dashboard/jobs/{ids['measured']}/trials/5").text
    error = _section(text, "Error")
    assert html_escaped(_trial(5)["result"]["error"]) in error and "s-oom" in text
    fix = error.split("<b>Fix:</b>")[1]
    assert "search.fsdp sweep cpu_offload true" in fix and "hardware.device_memory_limit" in fix
    assert "num_live_blocks" not in fix
    assert "No throughput: the trial ended oom" in text and "No trace" in text
    assert "The trial recorded no prediction" not in text and "No operators recorded" in text
    diverged = client.get(f"/dashboard/jobs/{ids['backends']}/trials/13").text
    assert "the tuner never picks it" in _section(diverged, "Error") and "search.fsdp" in _section(diverged, "Error")
    parity = _section(diverged, "Parity")
    assert "<td class='num bad'>0.21</td>" in parity and "no: diverged" in parity
    assert "(<b>5,000.0</b> tokens/s: not a throughput, the trial diverged)" in diverged


def test_a_missing_trial_or_job_is_the_dashboards_not_found_page(site):
    """Issue #46: /dashboard/jobs/ID/trials/8 was FastAPI's JSON 404."""
    client, ids = site
    for path in (f"/dashboard/jobs/{ids['measured']}/trials/99", f"/dashboard/jobs/{ids['measured']}/trials/x",
                 f"/dashboard/jobs/{ids['measured']}/trials/-1", "/dashboard/jobs/nope/trials/0",
                 f"/dashboard/jobs/{ids['queued']}/trials/0", f"/dashboard/jobs/{ids['measured']}/trials",
                 "/dashboard/nope", "/dashboard/jobs/"):
        r = client.get(path)
        assert r.status_code == 404 and r.headers["content-type"].startswith("text/html"), path
        assert "<h1>Not found</h1>" in r.text and "href='/dashboard'" in r.text, path
    assert "has no trial &#x27;99&#x27;" in client.get(f"/dashboard/jobs/{ids['measured']}/trials/99").text


def test_the_job_page_links_every_trial_and_its_plots_to_the_trials_page(site):
    client, ids = site
    job_id = ids["measured"]
    text = client.get(f"/dashboard/jobs/{job_id}").text
    for t in measured_job()["trials"]:
        n = t["number"]
        assert _row(text, n).startswith(f"<tr><td data-v='{n}'><a href='/dashboard/jobs/{job_id}/trials/{n}'")
        assert client.get(f"/dashboard/jobs/{job_id}/trials/{n}").status_code == 200
    best = _section(text, "Best config").split("<h3>Best per backend</h3>")[1]
    assert f"<td><a href='/dashboard/jobs/{job_id}/trials/2'>" in best
    # every plotted trial carries its number (the click handler opens its page)
    assert 'div.on("plotly_click"' in text and '"/trials/" + n' in text
    assert '"ids":["0","1","2"]' in _section(text, "History")           # DeepSpeed's trials, in one trace
    assert '"meta":{"trial":2}' in _section(text, "Time breakdown per backend")


def test_the_job_page_shows_each_picks_pooled_figure_everywhere(site):
    """Issue #46: the pie's title and the throughput star said trial #2's own 6,953 tokens/s while the Best config
    table said the pick's 5,219.0 (the median of #2's and #9's steps). Every place says 5,219.0 now."""
    client, ids = site
    text = client.get(f"/dashboard/jobs/{ids['measured']}").text
    best = _section(text, "Best config")
    assert "<th>tokens/s</th><td class='num'>5,219.0</td>" in best
    assert "<tr><td>deepspeed</td>" in best and "<td class='num'>5,219.0</td>" in best
    pies = _section(text, "Time breakdown per backend")
    # (Plotly's JSON writes / as \u002f)
    assert r"5,219.0 tok\u002fs (pooled over trials #2, #9; pie: trial #2)" in pies
    assert r"3,142.8 tok\u002fs (pooled over trials #7, #10; pie: trial #7)" in pies
    pick = {b: e["tokens_per_s"] for b, e in measured_job()["result"]["best_by_backend"].items()}
    stars = _traces(_section(text, "Throughput by backend"))["best of its backend"]
    assert stars["text"] == ["3,142.8", "5,219.0", "1,963.3"] and stars["ids"] == ["7", "2", "4"]
    assert stars["y"] == [pick["speedloader"], pick["deepspeed"], pick["fsdp"]]
    star = _traces(_section(text, "Throughput against the knobs"))["the pick"]      # SpeedLoader's trials only
    assert star["y"] == [pick["speedloader"]] and star["ids"] == ["7"] and star["marker"]["symbol"] == "star"
    for section in ("Best config", "Time breakdown per backend", "Throughput by backend"):
        assert "6,953" not in _section(text, section), section


def test_the_job_page_marks_each_trials_backend(site):
    client, ids = site
    text = client.get(f"/dashboard/jobs/{ids['measured']}").text
    backend = {str(t["number"]): t["result"]["config"]["backend"] for t in measured_job()["trials"]}
    history = _traces(_section(text, "History"))
    for b in ("speedloader", "deepspeed", "fsdp"):
        assert {backend[i] for i in history[f"{b} trial"]["ids"]} == {b}
    timeline = _traces(_section(text, "Trial timeline"))
    for b in ("speedloader", "deepspeed", "fsdp"):
        assert timeline[b]["legendgroup"] == "backend" and sorted(timeline[b]["ids"]) == \
            sorted(n for n, their in backend.items() if their == b)
    par = _traces(_section(text, "Parallel coordinates"))[None]["dimensions"]
    assert [d["label"] for d in par][:4] == ["backend", "sub_batch_size b", "num_sub_batches N", "num_live_blocks k"]
    assert "n/a" in par[3]["ticktext"] and "zero_stage" in [d["label"] for d in par]


def test_get_trials_names_every_trials_backend(site):
    """Issue #46: GET /jobs/{id}/trials gave SpeedLoader's trials no backend (their stored config names none) while
    best_by_backend named it. Every trial names it, beside its config and in it; a running one too."""
    client, ids = site
    trials = client.get(f"/jobs/{ids['measured']}/trials").json()
    expect = {t["number"]: t["result"]["config"]["backend"] for t in measured_job()["trials"]}
    assert {t["number"]: t["backend"] for t in trials} == expect
    assert {t["number"]: t["config"]["backend"] for t in trials} == expect
    assert "speedloader" in expect.values()
    running = client.get(f"/jobs/{ids['running']}/trials").json()
    assert [t["backend"] for t in running] == ["speedloader"] * 4 and running[3]["result"] is None
    assert [t["backend"] for t in client.get(f"/jobs/{ids['backends']}/trials").json()] == \
        ["speedloader"] * 9 + ["deepspeed"] * 3 + ["fsdp"] * 2
    schema = client.get("/openapi.json").json()["components"]["schemas"]["TrialOut"]
    assert "backend" in schema["required"] and schema["properties"]["backend"]["type"] == "string"


def test_the_machines_page_shows_each_stored_calibration_with_every_rate_and_its_spread(site):
    from sltune.machine import MachineRates, Workload, calibrate

    client, _ = site
    assert "No rates yet" in client.get("/dashboard/machines").text
    rates = calibrate(Workload(matmuls=((64, 96),), rows=(16,), hidden=64, heads=2, head_dim=32, seq_len=16),
                      budget_s=1)
    store = client.app.state.store
    store.save_rates(rates.fingerprint.key, "w1", rates.model_dump(mode="json"))
    page = client.get("/dashboard/machines")
    assert page.status_code == 200 and "No rates yet" not in page.text
    assert html.escape(rates.fingerprint.cpu) in page.text and rates.fingerprint.key in page.text
    for what, _, low, _, _, _ in rates.shown():
        assert html.escape(what) in page.text and low in page.text
    assert page.text.count("<tr>") == len(rates.shown()) + 1
    assert MachineRates.model_validate(store.all_rates()[0].rates) == rates
    assert "/dashboard/machines" in client.get("/dashboard").text                  # in the nav of every page
