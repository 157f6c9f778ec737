"""HTML pages under /dashboard: the job list, one job's figures, and two jobs compared.

Plain server-rendered HTML with Plotly figures (dashboards/figures.py). plotly.js comes from this app
(/dashboard/static/plotly.min.js, the copy inside the installed `plotly` package), never from a CDN:
the machines that run this are often offline. Every string a user chose (job names, errors) is
HTML-escaped; a running, failed or queued job shows what it has so far.
"""

from __future__ import annotations

import functools
import gzip
import html
import math
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import plotly
import plotly.graph_objects as go
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from sqlalchemy import select

from sltune.dashboards import figures
from sltune.tuning import compare as comparing
from sltune.service.jobs import job_detail
from sltune.service.progress import trial_counts, trials_run
from sltune.sizes import format_bytes
from sltune.store.schema import Artifact
from sltune.tuning.runner import optuna_storage
from sltune.tuning.study import param_importances

router = APIRouter(include_in_schema=False)

PLOTLY_JS_URL = f"/dashboard/static/plotly.min.js?v={plotly.__version__}"
ACTIVE = ("queued", "running")
e = html.escape

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:.6em 1.2em}
header a{color:#fff;text-decoration:none;margin-right:1.2em}header b{margin-right:1.5em}
main{padding:1em 1.5em;max-width:1400px}h1{font-size:1.4em;margin:.3em 0}
h2{font-size:1.15em;margin:1.4em 0 .4em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;background:#fff;font-size:.92em}
th,td{border:1px solid #ddd;padding:.3em .6em;text-align:left}th{background:#eceff1}td{white-space:nowrap}
td.wrap{white-space:normal;max-width:28em;overflow-wrap:anywhere}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.status{display:inline-block;padding:.05em .5em;border-radius:.8em;color:#fff;font-size:.85em}
.s-succeeded,.s-ok{background:#2e7d32}.s-running{background:#1565c0}.s-queued{background:#6d4c41}
.s-failed,.s-oom,.s-timeout{background:#c62828}.s-cancelled,.s-interrupted{background:#757575}
.note{color:#555;font-size:.9em}.error{background:#ffebee;border:1px solid #ef9a9a;padding:.5em;white-space:pre-wrap}
.fig{background:#fff;border:1px solid #e0e0e0;margin:.5em 0 1em}.bad{color:#c62828;font-weight:bold}
.good{color:#2e7d32;font-weight:bold}dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}
dt{color:#555}dd{margin:0}code{background:#eceff1;padding:0 .25em}
#trials th{cursor:pointer}#trials th.asc:after{content:" ▲"}#trials th.desc:after{content:" ▼"}
"""


# -- plumbing ---------------------------------------------------------------------------------------
def _page(title: str, body: str, *, plots: bool = False, refresh: int | None = None, status: int = 200) -> HTMLResponse:
    head = [f'<meta charset="utf-8"><title>{e(title)} · sltune</title>',
            '<meta name="viewport" content="width=device-width, initial-scale=1">', f"<style>{CSS}</style>"]
    if refresh:
        head.append(f'<meta http-equiv="refresh" content="{int(refresh)}">')
    if plots:
        head.append(f'<script src="{PLOTLY_JS_URL}"></script>')
    nav = ('<header><b>sltune</b><a href="/dashboard">jobs</a><a href="/dashboard/compare">compare</a>'
           '<a href="/docs">API</a></header>')
    return HTMLResponse(f'<!doctype html><html lang="en"><head>{"".join(head)}</head>'
                        f"<body>{nav}<main>{body}</main></body></html>", status_code=status)


def _not_found(what: str) -> HTMLResponse:
    return _page("not found", f"<h1>Not found</h1><p>{e(what)}</p><p><a href='/dashboard'>all jobs</a></p>",
                 status=404)


def _fig_html(fig: go.Figure | None, empty: str) -> str:
    if fig is None:
        return f'<p class="note">{e(empty)}</p>'
    fig.update_layout(title=None, margin_t=50)      # the page's heading names it
    return '<div class="fig">' + fig.to_html(full_html=False, include_plotlyjs=False,
                                             config={"displaylogo": False, "responsive": True}) + "</div>"


def _heading(title: str) -> str:
    """A section heading with an anchor (/dashboard/jobs/ID#parameter-importance links to it)."""
    return f"<h2 id='{title.lower().replace(' ', '-')}'>{e(title)}</h2>"


def _q(job_id: str) -> str:
    return quote(str(job_id), safe="")


def _badge(status: Any) -> str:
    s = str(status or "?")
    return f'<span class="status s-{e(s)}">{e(s)}</span>'


def _utc(v: Any) -> datetime | None:
    if not isinstance(v, datetime):
        return None
    return v.replace(tzinfo=timezone.utc) if v.tzinfo is None else v.astimezone(timezone.utc)


def _ts(v: Any) -> str:
    t = _utc(v)
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _duration(start: Any, end: Any) -> str:
    a, b = _utc(start), _utc(end) or datetime.now(timezone.utc)
    if a is None:
        return "-"
    s = max(0.0, (b - a).total_seconds())
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _num(v: Any, fmt: str = ",.1f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _bytes(v: Any) -> str:
    return format_bytes(int(v)) if isinstance(v, (int, float)) and v >= 0 else "-"


def _knobs(c: dict[str, Any] | None) -> str:
    c = c or {}
    if not c:
        return "-"
    return (f"b={e(str(c.get('sub_batch_size', '?')))} N={e(str(c.get('num_sub_batches', '?')))} "
            f"k={e(str(c.get('num_live_blocks', '?')))}")


def trial_dicts(store, job_id: str) -> list[dict[str, Any]]:
    """The job's trials as GET /jobs/{id}/trials gives them (what figures and compare() take)."""
    with store.Session() as s:
        traced = set(s.scalars(select(Artifact.trial_number).where(Artifact.job_id == job_id,
                                                                   Artifact.kind == "trace")))
    return [{"number": t.number, "role": t.role, "status": t.status, "config": t.config or {},
             "predicted": t.predicted or {}, "result": t.result, "started_at": t.started_at,
             "finished_at": t.finished_at,
             "trace_url": f"/jobs/{_q(job_id)}/trials/{t.number}/trace" if t.number in traced else None}
            for t in store.trials(job_id)]


# -- plotly.js, served by the app ------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _plotly_js() -> tuple[bytes, bytes, str]:
    path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    data = path.read_bytes()
    return data, gzip.compress(data, 6), f'"plotly-{plotly.__version__}-{len(data)}"'


@router.get("/dashboard/static/plotly.min.js")
def plotly_js(request: Request) -> Response:
    data, gz, etag = _plotly_js()
    headers = {"Cache-Control": "public, max-age=604800", "ETag": etag, "Vary": "Accept-Encoding"}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(gz, media_type="text/javascript; charset=utf-8",
                        headers={**headers, "Content-Encoding": "gzip"})
    return Response(data, media_type="text/javascript; charset=utf-8", headers=headers)


# -- the job list ----------------------------------------------------------------------------------
@router.get("/dashboard", response_class=HTMLResponse)
def job_list(request: Request, status: str | None = None, limit: int = 200) -> HTMLResponse:
    jobs = request.app.state.store.jobs(limit=max(1, min(limit, 1000)), status=status or None)
    rows = []
    for j in jobs:
        p = j.progress or {}
        r = j.result or {}
        best = r.get("best") or {}
        best_tps = best.get("tokens_per_s", p.get("best_tokens_per_s"))
        best_cfg = best.get("config") or p.get("best_config")
        done, finished = trials_run(p), j.status not in ACTIVE
        total = (done if finished      # a finished job ran all it will run, even when it stopped before its max
                 else int(p.get("trials_done") or 0) + p["confirm_planned"] if p.get("confirm_planned")
                 else p.get("max_trials") or 0)
        bar = f'<progress max="{int(total)}" value="{int(done)}"></progress> ' if total else ""
        qid = _q(j.id)
        links = [f"<a href='/dashboard/jobs/{qid}'>dashboard</a>", f"<a href='/jobs/{qid}'>JSON</a>",
                 f"<a href='/jobs/{qid}/trials'>trials</a>"]
        if j.status == "succeeded":
            links.append(f"<a href='/jobs/{qid}/config.yaml'>config.yaml</a>")
        rows.append(
            f"<tr><td><a href='/dashboard/jobs/{qid}'><code>{e(j.id)}</code></a></td><td class='wrap'>{e(j.name)}</td>"
            f"<td>{_badge(j.status)}</td><td>{bar}{trial_counts(p, finished) if p else '-'}"
            f"{' · ' + e(str(p.get('phase'))) if j.status == 'running' and p.get('phase') else ''}</td>"
            f"<td class='num'>{_num(best_tps)}</td><td>{_knobs(best_cfg) if best_cfg else '-'}</td>"
            f"<td>{_ts(j.created_at)}</td><td>{_duration(j.started_at, j.finished_at) if j.started_at else '-'}</td>"
            f"<td>{' · '.join(links)}</td></tr>")
    filters = " · ".join(f"<a href='/dashboard?status={s}'>{s}</a>" for s in
                         ("queued", "running", "succeeded", "failed", "cancelled"))
    table = ("<table><tr><th>job</th><th>name</th><th>status</th><th>trials</th><th>best tokens/s</th>"
             "<th>best config</th><th>created (UTC)</th><th>duration</th><th>links</th></tr>"
             + "".join(rows) + "</table>") if rows else "<p class='note'>No jobs yet: submit one with " \
                                                        "<code>sltune submit SPEC.yaml --server URL</code>.</p>"
    body = (f"<h1>Tuning jobs{' (' + e(status) + ')' if status else ''}</h1>"
            f"<p class='note'>show: <a href='/dashboard'>all</a> · {filters}</p>{table}"
            + (_compare_form(jobs) if len(jobs) >= 2 else ""))
    return _page("jobs", body, refresh=10 if any(j.status in ACTIVE for j in jobs) else None)


def _compare_form(jobs, a: str | None = None, b: str | None = None, max_regression: str = "5%") -> str:
    def options(selected: str | None) -> str:
        return "".join(f"<option value='{e(j.id)}'{' selected' if j.id == selected else ''}>"
                       f"{e(j.id)} · {e(j.name)} · {e(j.status)}</option>" for j in jobs)
    return ("<h2>Compare two jobs</h2><form method='get' action='/dashboard/compare'>"
            f"baseline A <select name='a'>{options(a or (jobs[1].id if len(jobs) > 1 else None))}</select> newer B "
            f"<select name='b'>{options(b or (jobs[0].id if jobs else None))}</select> allowed drop "
            f"<input name='max_regression' value='{e(max_regression)}' size='5'> "
            "<button type='submit'>compare</button></form>")


# -- one job ---------------------------------------------------------------------------------------
@router.get("/dashboard/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str, request: Request) -> HTMLResponse:
    store = request.app.state.store
    job = store.job(job_id)
    if job is None:
        return _not_found(f"no job {job_id!r}")
    detail = job_detail(store, job, request.app.state.settings)
    trials = trial_dicts(store, job.id)
    spec = job.spec or {}
    hw = spec.get("hardware") or {}
    result = job.result or {}
    progress = job.progress or {}
    best = result.get("best")
    qid = _q(job.id)

    parts = [f"<h1>{e(job.name)} <small><code>{e(job.id)}</code></small> {_badge(job.status)}</h1>",
             _job_summary(job, detail, spec, progress)]
    if job.error:
        parts.append(f"<div class='error'>{e(job.error)}</div>")

    parts.append(_heading("Best config"))
    parts.append(_best_section(job, best, result, progress, hw, qid))

    best_number = (best or {}).get("trial_number")
    parts.append(_heading("History"))
    parts.append(_fig_html(figures.history_figure(trials), "No finished trial yet."))
    parts.append(_heading("Parameter importance"))
    parts.append(_fig_html(figures.importance_figure(param_importances(optuna_storage(store.url), job.id)),
                           "Not enough successful trials with different knobs to say yet."))
    parts.append("<p class='note'>optuna.importance on the job's Optuna study: how much of the variation in "
                 "tokens/s each knob explains.</p>")
    parts.append(_heading("Parallel coordinates"))
    parts.append(_fig_html(figures.parallel_figure(trials), "Fewer than two successful trials yet."))
    parts.append("<p class='note'>One line per successful trial; drag along an axis to keep a range.</p>")
    parts.append(_heading("Throughput against the knobs"))
    parts.append(_fig_html(figures.throughput_figure(trials, best_number), "No finished trial yet."))
    parts.append("<p class='note'>One panel per num_sub_batches (N); colour: num_live_blocks (k); ★ the best "
                 "trial; crosses on the zero line: trials that ran out of memory or failed.</p>")

    parts.append(_heading("Measured peaks against the fitted models"))
    limits = {"device": hw.get("device_memory_limit"), "host": hw.get("host_memory_limit")}
    parts.append(_fig_html(figures.peaks_figure(detail.get("models"), trials, limits, spec),
                           "No fitted model or measured peak yet."))
    parts.append("<p class='note'>Log axes. Points below the red line fit in memory; points on the dashed "
                 "diagonal are predicted exactly. Margins: "
                 + e(", ".join(f"{k} {v:.0%}" for k, v in (result.get("margins") or {}).items()
                               if isinstance(v, (int, float))) or "-") + ".</p>")

    shown, total = figures.pie_trials(trials)
    parts.append(_heading("Time breakdown per trial"))
    if total > len(shown):
        parts.append(f"<p class='note'>Showing the {len(shown)} fastest of {total} ok trials with a breakdown "
                     "(the table below lists them all).</p>")
    parts.append(_fig_html(figures.breakdown_pies(trials),
                           "No ok trial with a time breakdown yet (breakdowns need search.profile: true)."))

    parts.append(_heading("Seconds per trial"))
    parts.append(_fig_html(figures.seconds_figure(trials), "No ok trial with a time breakdown yet."))
    parts.append(_heading("Trial timeline"))
    parts.append(_fig_html(figures.timeline_figure(trials), "No trial has started yet."))

    parts.append(_heading("Trials"))
    parts.append(_trials_table(trials, best_number))
    return _page(f"job {job.name}", "".join(parts), plots=True, refresh=15 if job.status in ACTIVE else None)


def _job_summary(job, detail: dict[str, Any], spec: dict[str, Any], progress: dict[str, Any]) -> str:
    model = spec.get("model") or {}
    wl = spec.get("workload") or {}
    hw = spec.get("hardware") or {}
    search = spec.get("search") or {}
    items = [
        ("model", e(str(model.get("preset") or (f"{Path(str(model['path'])).name} (model folder)" if model.get("path")
                        else (model.get("hf_config") or {}).get("model_type", "?"))))
         + f" ({e(str(model.get('dtype', '')))}"
         + (", mixed precision" if model.get("mixed_precision", True) and model.get("dtype", "float32") != "float32"
            else "") + ")"),
        ("optimizer", e(", ".join(f"{k}={v}" for k, v in (spec.get("optimizer") or {"name": "adamw"}).items()
                                  if v is not None))),
        ("workload", e(", ".join(f"{k}={v}" for k, v in wl.items()))),
        ("hardware", e(f"{hw.get('device', '?')}, device limit {_bytes(hw.get('device_memory_limit'))}, host limit "
                       f"{_bytes(hw.get('host_memory_limit'))}, world size {hw.get('world_size', 1)}")),
        ("strategy", e(str(search.get("strategy", "?")))),
        ("progress", f"{trial_counts(progress, job.status not in ACTIVE)} trials"
                     + ("" if job.status in ACTIVE else ", finished")
                     + (f", phase {e(str(progress.get('phase')))}" if progress.get("phase") and job.status in ACTIVE
                        else "")
                     + (f", {_num(progress.get('elapsed_s'), '.0f')}s elapsed" if progress.get("elapsed_s") else "")
                     + (f", about {_num(progress.get('time_left_s'), '.0f')}s left"
                        if job.status == "running" else "")),
        ("created / started / finished (UTC)",
         f"{_ts(job.created_at)} / {_ts(job.started_at)} / {_ts(job.finished_at)}"),
    ]
    stop = detail.get("stop_reason") or progress.get("stop_reason")
    if stop:
        items.append(("stopped because", e(str(stop))))
    if detail.get("waiting_for"):
        items.append(("waiting for", e(str(detail["waiting_for"]))))
    if detail.get("cancel_requested") and job.status == "running":
        items.append(("cancel", "requested; the worker stops after the current trial"))
    qid = _q(job.id)
    items.append(("API", f"<a href='/jobs/{qid}'>/jobs/{e(job.id)}</a> · <a href='/jobs/{qid}/trials'>trials</a>"
                         f" · <a href='/dashboard/compare?b={qid}'>compare with…</a>"))
    return "<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def _best_section(job, best: dict[str, Any] | None, result: dict[str, Any], progress: dict[str, Any],
                  hw: dict[str, Any], qid: str) -> str:
    if not best:
        so_far = progress.get("best_config")
        if so_far and job.status in ACTIVE:
            return (f"<p>Best so far: {_knobs(so_far)} at {_num(progress.get('best_tokens_per_s'))} tokens/s "
                    "(the config file is ready once the job has succeeded).</p>")
        why = " yet." if job.status in ACTIVE else ": no trial ran successfully."
        return f"<p class='note'>No best config{why}</p>"
    c = best.get("config") or {}
    pred = result.get("predicted") or {}
    rows = [("sub_batch_size (b)", e(str(c.get("sub_batch_size"))), ""),
            ("num_sub_batches (N)", e(str(c.get("num_sub_batches"))), ""),
            ("num_live_blocks (k)", e(str(c.get("num_live_blocks"))), ""),
            ("schedule", e(str(c.get("schedule", "-"))), ""),
            ("tokens/s", _num(best.get("tokens_per_s")), _num(pred.get("tokens_per_s"))),
            ("step seconds", _num(best.get("step_seconds"), ".3f"), _num(pred.get("step_seconds"), ".3f")),
            ("device peak", _bytes(best.get("peak_device_bytes")), _bytes(pred.get("peak_device_bytes"))),
            ("host peak", _bytes(best.get("peak_host_bytes")), _bytes(pred.get("peak_host_bytes")))]
    table = ("<table><tr><th></th><th>measured</th><th>predicted</th></tr>"
             + "".join(f"<tr><th>{k}</th><td class='num'>{m}</td><td class='num'>{p}</td></tr>" for k, m, p in rows)
             + "</table>")
    link = (f"<p><a href='/jobs/{qid}/config.yaml' download='best-{qid}.yaml'><b>Download the config "
            f"(config.yaml)</b></a> · train with it: <code>sltune train --config best.yaml</code></p>"
            if job.status == "succeeded" else "")
    limit = result.get("binding_limit")
    if result.get("confidence"):
        link += f"<p class='confidence'>Confidence: <b>{e(str(result['confidence']))}</b></p>"
    return (f"{link}<p>{_measured_in(best)}; the limit that stops a larger config: "
            f"<b>{e(str(limit or '-'))}</b> (device {_bytes(hw.get('device_memory_limit'))}, host "
            f"{_bytes(hw.get('host_memory_limit'))}).</p>{table}")


def _measured_in(best: dict[str, Any]) -> str:
    """Which trials the best's figure pools: "Trials #9, #13, #15 (1 search + 2 confirm): tokens/s is the
    median of all their steps, 95% interval [...]"."""
    numbers = best.get("from_trials") or [best.get("trial_number")]
    ci = best.get("tokens_per_s_ci95")
    interval = f", 95% interval [{_num(ci[0])}, {_num(ci[1])}]" if ci else ""
    if len(numbers) < 2:
        return f"Trial #{e(str(numbers[0]))}{interval}"
    return (f"Trials {', '.join('#' + e(str(n)) for n in numbers)} ({int(best.get('search_trials') or 0)} search + "
            f"{int(best.get('confirm_trials') or 0)} confirm): tokens/s is the median of all their steps{interval}")


TABLE_JS = """
function sltuneSort(th) {
  const table = th.closest("table"), col = [...th.parentNode.children].indexOf(th), asc = th.dataset.asc !== "1";
  th.parentNode.querySelectorAll("th").forEach(h => { delete h.dataset.asc; h.classList.remove("asc", "desc"); });
  th.dataset.asc = asc ? "1" : "0"; th.classList.add(asc ? "asc" : "desc");
  const key = row => { const c = row.cells[col], v = c.dataset.v ?? c.textContent.trim(), n = parseFloat(v);
                       return isNaN(n) ? v.toLowerCase() : n; };
  const rows = [...table.tBodies[0].rows];
  rows.sort((a, b) => { const x = key(a), y = key(b);
    if (typeof x !== typeof y) return typeof x === "number" ? -1 : 1;
    return (x < y ? -1 : x > y ? 1 : 0) * (asc ? 1 : -1); });
  rows.forEach(r => table.tBodies[0].appendChild(r));
}
function sltuneFilter(input) {
  const words = input.value.toLowerCase().split(/\\s+/).filter(Boolean);
  let shown = 0;
  document.querySelectorAll("#trials tbody tr").forEach(r => {
    const text = r.textContent.toLowerCase(); r.hidden = !words.every(w => text.includes(w)); shown += !r.hidden; });
  document.getElementById("trials-shown").textContent = shown;
}
// a link can carry the view: ?filter=oom&sort=tokens/s
const view = new URLSearchParams(location.search), filterBox = document.getElementById("trials-filter");
if (view.get("filter")) { filterBox.value = view.get("filter"); sltuneFilter(filterBox); }
const sortBy = [...document.querySelectorAll("#trials th")].find(h => h.textContent === view.get("sort"));
if (sortBy) sltuneSort(sortBy);
"""


def _trials_table(trials: list[dict[str, Any]], best_number: int | None) -> str:
    """Every trial; a click on a heading sorts by it, the box keeps the rows that contain every word typed."""
    if not trials:
        return "<p class='note'>No trials yet.</p>"
    heads = ["#", "role", "status", "config", "tokens/s", "device peak", "host peak", "setup", "host at start",
             "duration", "trace", "error"]
    head = "".join(f"<th onclick='sltuneSort(this)' title='sort'>{h}</th>" for h in heads)
    rows = []
    for t in trials:
        r = t.get("result") or {}
        timing = r.get("timing") or {}      # setup: fork to first step; host at start: RSS then
        trace = (f"<a href='{e(t['trace_url'])}'>trace.json</a>" if t.get("trace_url") else "-")
        star = " ★" if t.get("number") == best_number else ""
        a, b = _utc(t.get("started_at")), _utc(t.get("finished_at"))
        seconds = (b - a).total_seconds() if a and b else None

        def num(v: Any, shown: str) -> str:
            return f"<td class='num' data-v='{v if isinstance(v, (int, float)) else ''}'>{shown}</td>"

        rows.append(
            f"<tr><td data-v='{e(str(t.get('number')))}'>{e(str(t.get('number')))}{star}</td>"
            f"<td>{e(str(t.get('role') or '-'))}</td><td>{_badge(t.get('status'))}</td><td>{_knobs(t.get('config'))}</td>"
            + num(r.get("tokens_per_s"), _num(r.get("tokens_per_s")))
            + num(r.get("peak_device_bytes"), _bytes(r.get("peak_device_bytes")))
            + num(r.get("peak_host_bytes"), _bytes(r.get("peak_host_bytes")))
            + num(timing.get("setup_s"), "-" if timing.get("setup_s") is None else f"{timing['setup_s']:.1f} s")
            + num(timing.get("host_bytes_at_start"), _bytes(timing.get("host_bytes_at_start")))
            + num(seconds, _duration(t.get("started_at"), t.get("finished_at")))
            + f"<td>{trace}</td><td class='wrap'>{e(str(r.get('error') or ''))}</td></tr>")
    return ("<p class='note'><b>setup</b> is a trial's time from its fork to its first step (building the model "
            "on the meta device and filling the engine's buffers, or reading a checkpoint); <b>host at start</b> its "
            "resident memory then. Traces are Chrome trace JSON: open them in Perfetto (ui.perfetto.dev, "
            "“Open trace file”) or chrome://tracing. Click a heading to sort; a link keeps the view with "
            "<code>?filter=oom&amp;sort=tokens/s</code>.</p>"
            "<p><input id='trials-filter' size='40' placeholder='filter: ok, probe, b=4, oom ...' "
            f"oninput='sltuneFilter(this)'> <span class='note'><span id='trials-shown'>{len(trials)}</span> of "
            f"{len(trials)} trials</span></p><table id='trials'><thead><tr>{head}</tr></thead><tbody>"
            + "".join(rows) + f"</tbody></table><script>{TABLE_JS}</script>")


# -- two jobs compared -----------------------------------------------------------------------------
def _fraction(text: str) -> float | None:
    t = (text or "").strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        return None
    return v if 0 <= v < 1 else None


def _interval(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-"


@router.get("/dashboard/compare", response_class=HTMLResponse)
def compare_page(request: Request, a: str | None = None, b: str | None = None,
                 max_regression: str = "5%") -> HTMLResponse:
    store = request.app.state.store
    jobs = store.jobs(limit=200)
    limit = _fraction(max_regression)
    if limit is None:
        return _page("compare", f"<h1>Compare two jobs</h1><p class='error'>max_regression {e(max_regression)!s}: "
                                "write a percentage such as 5% or a fraction such as 0.05</p>"
                                + _compare_form(jobs, a, b), status=400)
    if not a or not b:
        return _page("compare", "<h1>Compare two jobs</h1><p class='note'>Throughput per config of a baseline "
                                "job A and a newer job B, as <code>sltune compare A B --server URL</code> checks "
                                "it in CI.</p>" + (_compare_form(jobs, a, b, max_regression) if jobs else
                                                   "<p>No jobs yet.</p>"))
    job_a, job_b = store.job(a), store.job(b)
    if job_a is None or job_b is None:
        return _not_found(f"no job {(a if job_a is None else b)!r}")
    try:
        cmp = comparing.compare(comparing.from_store(store, job_a.id), comparing.from_store(store, job_b.id), limit)
    except ValueError as err:          # unfinished, or no successful trial: nothing to compare (CLI exit 2)
        cmp, why = {"rows": [], "best_a": None, "best_b": None}, str(err)
    if cmp.get("verdict") is None:
        verdict = f"<span class='bad'>nothing to compare</span>: {e(why)}"
    else:
        lo, hi = cmp["ci95"]
        good = cmp["verdict"] != "regression"
        word = cmp["verdict"] if good else "REGRESSION"
        verdict = (f"<span class='{'good' if good else 'bad'}'>{word}</span>: best B/A {cmp['ratio']:.3f}x (change {cmp['change']:+.1%}), 95% interval "
                   f"[{lo:.3f}, {hi:.3f}], allowed drop {limit:.1%}")
        if cmp["verdict"] == "inconclusive":
            a, b = cmp["busy_elsewhere"]
            verdict += (f" <span class='note'>(other processes kept {a:.2f} cores busy while A's best was "
                        f"measured, {b:.2f} while B's: the jobs' trials cannot tell the code from the machine; "
                        "re-measure with <code>sltune compare --remeasure</code>)</span>")
        elif cmp["measured_under_interference"]:
            verdict += (" <span class='note'>(measured under interference: "
                        + e("; ".join(cmp["measured_under_interference"])) + "; re-measure with <code>--remeasure"
                        "</code>)</span>")
    label_a, label_b = f"A: {e(job_a.name)} ({e(job_a.id)})", f"B: {e(job_b.name)} ({e(job_b.id)})"
    summary = ("<table><tr><th></th><th>job</th><th>status</th><th>best tokens/s</th></tr>"
               + "".join(f"<tr><th>{k}</th><td><a href='/dashboard/jobs/{_q(j.id)}'>{e(j.name)} "
                         f"<code>{e(j.id)}</code></a></td><td>{_badge(j.status)}</td>"
                         f"<td class='num'>{_num(v)}</td></tr>"
                         for k, j, v in (("A (baseline)", job_a, cmp["best_a"]), ("B (newer)", job_b, cmp["best_b"])))
               + "</table>")
    rows = "".join(
        f"<tr><td>{e(comparing.config_name(r['config']))}</td><td class='num'>{_num(r['a'])}</td>"
        f"<td class='num'>{_num(r['b'])}</td>"
        f"<td class='num{' bad' if r.get('verdict') == 'regression' else ''}'>{_num(r['ratio'], '.3f')}</td>"
        f"<td class='num'>{_interval(r.get('ci95'))}</td><td>{e(r.get('verdict') or '-')}</td></tr>"
        for r in cmp["rows"])
    table = ("<table><tr><th>config</th><th>A tokens/s</th><th>B tokens/s</th><th>B / A</th><th>95% interval</th>"
             "<th>verdict</th></tr>" + rows + "</table>") if rows else \
        "<p class='note'>Neither job has a successful trial.</p>"
    swap = f"/dashboard/compare?{urlencode({'a': job_b.id, 'b': job_a.id, 'max_regression': max_regression})}"
    body = (f"<h1>Compare {e(job_a.name)} → {e(job_b.name)}</h1>{summary}<p>Verdict: {verdict} "
            f"(as <code>sltune compare {e(job_a.id)} {e(job_b.id)} --max-regression {e(max_regression)}</code> "
            f"decides). <a href='{e(swap)}'>swap A and B</a></p>"
            + _fig_html(figures.compare_figure(cmp, label_a, label_b, limit), "No successful trial to compare.")
            + "<p class='note'>Per config: the median tokens/s of every step each job timed for it, and the "
              "ratio B/A with its 95% bootstrap interval. The verdict compares the two jobs' best configs: a "
              "regression only when the whole interval lies below 1 − the allowed drop; an interval that "
              "reaches above it is <i>within noise</i>; two bests measured under different interference "
              "(other processes' busy cores differing by half a core or more) are <i>inconclusive</i>.</p>"
            + table + _compare_form(jobs, job_a.id, job_b.id, max_regression))
    active = job_a.status in ACTIVE or job_b.status in ACTIVE
    return _page("compare", body, plots=True, refresh=15 if active else None)
