"""HTML pages under /dashboard: the job list, one job's figures, and two jobs compared.

Plain server-rendered HTML with Plotly figures (sltune/dashboards/figures.py). plotly.js comes from this app
(/dashboard/static/plotly.min.js, the copy inside the installed `plotly` package), never from a CDN:
the machines that run this are often offline. This module gathers each page's data; the Jinja2
templates in sltune/dashboards/templates/ lay it out (base.html the shared head, nav and style). Templates
autoescape, so every string a user chose (job names, errors) is HTML-escaped; only Plotly's figure
divs are inserted raw (|safe in macros.html). A running, failed or queued job shows what it has so far.
A job over several backends (SpeedLoader, DeepSpeed, FSDP; issue #33) shows them side by side: each one's best
and its breakdown pie, every trial's throughput by backend, a backend column and picker in the trials table; with
one backend the page is as it was, plus the table's backend and parity columns.
"""

from __future__ import annotations

import functools
import gzip
import html
import math
import re
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import plotly
import plotly.graph_objects as go
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from sltune.dashboards import figures, peaks, trial_figures
from sltune.tuning.report import compare as comparing
from sltune.service.jobs import job_detail
from sltune.service.progress import trial_counts, trials_run
from sltune.service.trials import trial_view, trial_views
from sltune.sizes import format_bytes
from sltune.tuning.report.fixes import fix_of
from sltune.tuning.search.study import optuna_storage
from sltune.tuning.search.study import param_importances

router = APIRouter(include_in_schema=False)

PLOTLY_JS_URL = f"/dashboard/static/plotly.min.js?v={plotly.__version__}"
ACTIVE = ("queued", "running")


def _escape(value: Any) -> Any:
    """html.escape every value a template prints, as the f-string pages did: the same entities (&quot;, &#x27;)
    where markupsafe would write &#34; and &#39;, so links and text keep their bytes. Markup (macros, |safe) passes."""
    return value if hasattr(value, "__html__") else Markup(html.escape(str(value)))


# the templates sit beside this file, in the source tree and in an installed wheel (package data)
templates = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"),
                        autoescape=select_autoescape(["html"]), trim_blocks=True, lstrip_blocks=True,
                        undefined=StrictUndefined, finalize=_escape, auto_reload=False)
templates.globals["plotly_js_url"] = PLOTLY_JS_URL


# -- plumbing ---------------------------------------------------------------------------------------
def _page(template: str, title: str, *, plots: bool = False, refresh: int | None = None, status_code: int = 200,
          **context: Any) -> HTMLResponse:
    """A page: a template that extends base.html, which takes the title, plots (load plotly.js) and refresh."""
    body = templates.get_template(template).render(title=title, plots=plots, refresh=refresh, **context)
    return HTMLResponse(body, status_code=status_code)


def _not_found(what: str) -> HTMLResponse:
    return _page("not_found.html", "not found", what=what, status_code=404)


def _plot(fig: go.Figure | None) -> str | None:
    """The figure's div, which macros.html's figure() inserts raw: plotly's HTML, never a user's text
    (figures.py gets user strings escaped). None: no figure, the page says why."""
    if fig is None:
        return None
    fig.update_layout(title=None, margin_t=50)      # the page's heading names it
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False, "responsive": True})


def fig_html(fig: go.Figure | None, empty: str) -> str:
    """One figure as the pages draw it (the figure() macro), for laying figures out outside a page (tests)."""
    return templates.get_template("macros.html").module.figure(_plot(fig), empty)


def _q(job_id: str) -> str:
    return quote(str(job_id), safe="")


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
    """"b=2 N=4 k=1", or another backend's "deepspeed b=2 N=4 zero_stage=3 ..." (figures.config_label)."""
    return figures.config_label(c) if c else "-"


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
        best_cfg = best.get("config") or p.get("best_config")
        done, finished = trials_run(p), j.status not in ACTIVE
        total = (done if finished      # a finished job ran all it will run, even when it stopped before its max
                 else int(p.get("trials_done") or 0) + p["confirm_planned"] if p.get("confirm_planned")
                 else p.get("max_trials") or 0)
        rows.append({"id": j.id, "qid": _q(j.id), "name": j.name, "status": j.status,
                     "planned": int(total), "done": int(done),     # the progress bar, when there is a total
                     "trials": trial_counts(p, finished) if p else "-",
                     "phase": str(p.get("phase")) if j.status == "running" and p.get("phase") else None,
                     "best_tokens_per_s": _num(best.get("tokens_per_s", p.get("best_tokens_per_s"))),
                     "best_config": _knobs(best_cfg) if best_cfg else "-", "created": _ts(j.created_at),
                     "duration": _duration(j.started_at, j.finished_at) if j.started_at else "-"})
    return _page("job_list.html", "jobs", status=status, jobs=rows,
                 form=_compare_form(jobs) if len(jobs) >= 2 else None,
                 refresh=10 if any(j.status in ACTIVE for j in jobs) else None)


def _compare_form(jobs, a: str | None = None, b: str | None = None, max_regression: str = "5%") -> dict[str, Any]:
    """What macros.html's compare_form() shows: by default the newest job as B against the one before as A."""
    return {"jobs": jobs, "a": a or (jobs[1].id if len(jobs) > 1 else None), "b": b or (jobs[0].id if jobs else None),
            "max_regression": max_regression}


# -- one job ---------------------------------------------------------------------------------------
@router.get("/dashboard/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str, request: Request) -> HTMLResponse:
    store = request.app.state.store
    job = store.job(job_id)
    if job is None:
        return _not_found(f"no job {job_id!r}")
    detail = job_detail(store, job, request.app.state.settings)
    trials = trial_views(store, job.id)
    spec = job.spec or {}
    hw = spec.get("hardware") or {}
    result = job.result or {}
    progress = job.progress or {}
    best = result.get("best")
    best_number = (best or {}).get("trial_number")
    picks = figures.picks_of(result)        # a pick's one figure, wherever the page shows the pick
    limits = {"device": hw.get("device_memory_limit"), "host": hw.get("host_memory_limit")}
    shown, total = figures.pie_trials(trials)
    # issue #33: a job over several backends, or on one other than SpeedLoader, shows them side by side
    backends = figures.backends_in(t for t in trials if figures.status_of(t) != "running")
    by_backend = backends not in ([], ["speedloader"])
    bests = figures.backend_bests(trials, result) if by_backend else {}
    figs = {"history": figures.history_figure(trials),
            "importance": figures.importance_figure(param_importances(optuna_storage(store.url), job.id)),
            "parallel": figures.parallel_figure(trials),
            "by_backend": figures.backend_throughput_figure(trials, bests, picks) if by_backend else None,
            # SpeedLoader's trials only: its best is starred (the job's best may be another backend's)
            "throughput": figures.throughput_figure(trials, bests["speedloader"]["number"] if "speedloader" in bests
                                                    else best_number, picks=picks),
            "peaks": peaks.peaks_figure(detail.get("models"), trials, limits, spec),
            "pies": figures.backend_pies(trials, bests, picks=picks) if len(backends) > 1
            else figures.breakdown_pies(trials, picks=picks),
            "seconds": figures.seconds_figure(trials),
            "timeline": figures.timeline_figure(trials)}
    so_far = progress.get("best_config") if job.status in ACTIVE else None
    return _page("job.html", f"job {job.name}", plots=True, refresh=15 if job.status in ACTIVE else None,
                 job=job, qid=_q(job.id), active=job.status in ACTIVE,
                 summary=_job_summary(job, detail, spec, progress),
                 best=_best(best, result, hw, trials, named=len(backends) > 1) if best else None,
                 backends=backends, by_backend=by_backend,
                 backend_bests=_backend_bests(bests, picks) if len(backends) > 1 else [],
                 so_far={"knobs": _knobs(so_far), "tokens_per_s": _num(progress.get("best_tokens_per_s"))}
                 if so_far else None,
                 figs={name: _plot(fig) for name, fig in figs.items()},
                 margins=", ".join(f"{k} {v:.0%}" for k, v in (result.get("margins") or {}).items()
                                   if isinstance(v, (int, float))) or "-",
                 pies_shown=len(shown), pies_total=total, trials=_trial_rows(trials, best_number))


def _job_summary(job, detail: dict[str, Any], spec: dict[str, Any], progress: dict[str, Any]) -> list[tuple[str, str]]:
    """The job page's (label, text) pairs above the figures: what ran, on what, how far it got."""
    model = spec.get("model") or {}
    wl = spec.get("workload") or {}
    hw = spec.get("hardware") or {}
    search = spec.get("search") or {}
    items = [
        ("model", str(model.get("preset") or (f"{Path(str(model['path'])).name} (model folder)" if model.get("path")
                      else (model.get("hf_config") or {}).get("model_type", "?")))
         + f" ({model.get('dtype', '')}"
         + (", mixed precision" if model.get("mixed_precision", True) and model.get("dtype", "float32") != "float32"
            else "") + ")"),
        ("optimizer", ", ".join(f"{k}={v}" for k, v in (spec.get("optimizer") or {"name": "adamw"}).items()
                                if v is not None)),
        ("workload", ", ".join(f"{k}={v}" for k, v in wl.items())),
        ("hardware", (f"{hw.get('device', '?')}, device limit {_bytes(hw.get('device_memory_limit'))}, host limit "
                      f"{_bytes(hw.get('host_memory_limit'))}, world size {hw.get('world_size', 1)}")),
        ("strategy", str(search.get("strategy", "?"))),
        ("progress", f"{trial_counts(progress, job.status not in ACTIVE)} trials"
                     + ("" if job.status in ACTIVE else ", finished")
                     + (f", phase {progress.get('phase')}" if progress.get("phase") and job.status in ACTIVE
                        else "")
                     + (f", {_num(progress.get('elapsed_s'), '.0f')}s elapsed" if progress.get("elapsed_s") else "")
                     + (f", about {_num(progress.get('time_left_s'), '.0f')}s left"
                        if job.status == "running" else "")),
        ("created / started / finished (UTC)",
         f"{_ts(job.created_at)} / {_ts(job.started_at)} / {_ts(job.finished_at)}"),
    ]
    prior = detail.get("step_prior")
    if prior:       # each trial's step predicted from the machine's rates, corrected by the trials before it
        moved = "; ".join(f"{backend} {fix['text']}" for backend, fix in (prior.get("corrections") or {}).items()
                          if fix) or "no trial has corrected them yet"
        items.append(("step-time prior", f"from rates calibrated {str(prior.get('measured_at', ''))[:16]} on "
                                          f"{prior.get('rates')}"
                                          + ("; the search ranked every config by it" if prior.get("guided") else "")
                                          + f"; {moved}"))
    stop = detail.get("stop_reason") or progress.get("stop_reason")
    if stop:
        items.append(("stopped because", str(stop)))
    if detail.get("waiting_for"):
        items.append(("waiting for", str(detail["waiting_for"])))
    if detail.get("cancel_requested") and job.status == "running":
        items.append(("cancel", "requested; the worker stops after the current trial"))
    return items


def _best(best: dict[str, Any], result: dict[str, Any], hw: dict[str, Any],
          trials: list[dict[str, Any]] | None = None, named: bool = False) -> dict[str, Any]:
    """The best config measured against what the models predicted for it, and what bounds it. A best of another
    backend than SpeedLoader names it and its own knobs instead of k and the schedule; `named`: name SpeedLoader
    too (the job ran several backends)."""
    c = best.get("config") or {}
    pick = next((t for t in trials or [] if t.get("number") == best.get("trial_number")), None)
    if "backend" not in c and pick is not None:
        c = {**comparing.trial_config(pick), **c}       # the pick's result names its backend
    pred = result.get("predicted") or {}
    backend = figures.backend_of(c)
    if backend == "speedloader":
        own = [("num_live_blocks (k)", str(c.get("num_live_blocks")), ""),
               ("schedule", str(c.get("schedule", "-")), "")]
    else:
        knobs = comparing.normalized(c)
        own = [(k, comparing.knob_value(knobs[k]), "") for k in comparing.BACKEND_KNOBS.get(backend, ())]
    if backend != "speedloader" or named:
        own.insert(0, ("backend", backend, ""))
    rows = [("sub_batch_size (b)", str(c.get("sub_batch_size")), ""),
            ("num_sub_batches (N)", str(c.get("num_sub_batches")), ""),
            *own,
            ("tokens/s", _num(best.get("tokens_per_s")), _num(pred.get("tokens_per_s"))),
            ("step seconds", _num(best.get("step_seconds"), ".3f"), _num(pred.get("step_seconds"), ".3f")),
            ("device peak", _bytes(best.get("peak_device_bytes")), _bytes(pred.get("peak_device_bytes"))),
            ("host peak", _bytes(best.get("peak_host_bytes")), _bytes(pred.get("peak_host_bytes")))]
    return {"rows": rows, "measured_in": _measured_in(best), "binding_limit": str(result.get("binding_limit") or "-"),
            "confidence": str(result["confidence"]) if result.get("confidence") else None,
            "device_limit": _bytes(hw.get("device_memory_limit")), "host_limit": _bytes(hw.get("host_memory_limit"))}


def _measured_in(best: dict[str, Any]) -> str:
    """Which trials the best's figure pools: "Trials #9, #13, #15 (1 search + 2 confirm): tokens/s is the
    median of all their steps, 95% interval [...]"."""
    numbers = best.get("from_trials") or [best.get("trial_number")]
    ci = best.get("tokens_per_s_ci95")
    interval = f", 95% interval [{_num(ci[0])}, {_num(ci[1])}]" if ci else ""
    if len(numbers) < 2:
        return f"Trial #{numbers[0]}{interval}"
    return (f"Trials {', '.join(f'#{n}' for n in numbers)} ({int(best.get('search_trials') or 0)} search + "
            f"{int(best.get('confirm_trials') or 0)} confirm): tokens/s is the median of all their steps{interval}")


def _cell(v: Any, shown: str) -> dict[str, Any]:
    """A sortable cell (macros.html num_cell): the raw number (data-v, "" for none) and its display."""
    return {"value": v if isinstance(v, (int, float)) else "", "shown": shown}


def _g(v: Any, fmt: str = ".2g") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "?"


def _parity(trial: dict[str, Any]) -> dict[str, Any]:
    """A trial's parity cell: "ok", or how far its step-1 loss was off plain PyTorch's (sorted by rel_diff); the
    title spells out both losses. "-": not checked (generation, or a trial from before the check)."""
    p = figures.parity_of(trial)
    if p is None:
        return {**_cell(None, "-"), "bad": False, "title": ""}
    rel = p.get("rel_diff")
    title = (f"step-1 loss {_g(p.get('loss'), '.6g')} against plain PyTorch's {_g(p.get('reference_loss'), '.6g')}: "
             f"relative difference {_g(rel)}, tolerance {_g(p.get('tolerance'))}")
    shown = "ok" if p.get("ok") else f"off: {_g(rel)}"
    return {**_cell(rel, shown), "bad": not p.get("ok"), "title": title}


def _trial_rows(trials: list[dict[str, Any]], best_number: int | None) -> list[dict[str, Any]]:
    """The trials table's rows; a number cell keeps its raw value (data-v) for the table's sort. A diverged
    trial's tokens/s is shown in parentheses and sorts as none: it ran, but not training the model correctly."""
    cell = _cell
    rows = []
    for t in trials:
        r = t.get("result") or {}
        timing = r.get("timing") or {}      # setup: fork to first step; host at start: RSS then
        a, b = _utc(t.get("started_at")), _utc(t.get("finished_at"))
        setup, host_at_start = timing.get("setup_s"), timing.get("host_bytes_at_start")
        diverged = figures.status_of(t) == "diverged"
        rows.append({"number": str(t.get("number")), "best": t.get("number") == best_number and not diverged,
                     "role": str(t.get("role") or "-"), "status": t.get("status"),
                     "backend": figures.backend_of(t), "knobs": figures.knob_text(t) if t.get("config") else "-",
                     "tokens_per_s": cell(None, f"({_num(r.get('tokens_per_s'))})") if diverged
                     else cell(r.get("tokens_per_s"), _num(r.get("tokens_per_s"))),
                     "parity": _parity(t),
                     "device_peak": cell(r.get("peak_device_bytes"), _bytes(r.get("peak_device_bytes"))),
                     "host_peak": cell(r.get("peak_host_bytes"), _bytes(r.get("peak_host_bytes"))),
                     "setup": cell(setup, "-" if setup is None else f"{setup:.1f} s"),
                     "host_at_start": cell(host_at_start, _bytes(host_at_start)),
                     "duration": cell((b - a).total_seconds() if a and b else None,
                                      _duration(t.get("started_at"), t.get("finished_at"))),
                     "trace_url": t.get("trace_url"), "error": str(r.get("error") or "")})
    return rows


def _backend_bests(bests: dict[str, dict[str, Any]], picks: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The job page's best per backend (several backends): the figure of the job result's pick that pools that
    trial (best_by_backend's, or the best's), else the trial's own."""
    rows = []
    for backend, t in bests.items():
        entry = picks.get(t.get("number"))
        rows.append({"backend": backend, "knobs": figures.knob_text(t), "number": t.get("number"),
                     "tokens_per_s": _num(figures.pick_figure(t, picks)),
                     "measured_in": _measured_in(entry) if entry else f"Trial #{t.get('number')}",
                     "parity": _parity(t)})
    return rows


# -- one trial -------------------------------------------------------------------------------------
@router.get("/dashboard/jobs/{job_id}/trials/{number}", response_class=HTMLResponse)
def trial_page(job_id: str, number: str, request: Request) -> HTMLResponse:
    """One trial: its config, figure and interval, predictions, breakdown, top operators, parity, trace and error.
    A trial number that is not one of the job's is the not-found page, as an unknown job is."""
    store = request.app.state.store
    job = store.job(job_id)
    if job is None:
        return _not_found(f"no job {job_id!r}")
    row = store.trial(job.id, int(number)) if re.fullmatch(r"[0-9]{1,9}", number) else None
    if row is None:
        return _not_found(f"job {job.name} ({job.id}) has no trial {number!r}")
    t = trial_view(job.id, row, store.artifact(job.id, row.number, "trace") is not None)
    r = t["result"] or {}
    picks = figures.picks_of(job.result)
    status = figures.status_of(t)
    return _page("trial.html", f"trial #{row.number} · job {job.name}", plots=True,
                 refresh=15 if status == "running" else None, job=job, qid=_q(job.id), trial=t, status=status,
                 summary=_trial_summary(t, picks), config=_config_rows(t), throughput=_throughput(t),
                 measured=_measured_predicted(t), breakdown=_breakdown_rows(t), top_ops=_top_ops(r),
                 parity=_parity_table(t), error=str(r.get("error") or ""), trace_error=str(r.get("trace_error") or ""),
                 fix=fix_of(status, t["backend"], r.get("oom_resource"), r.get("error")),
                 figs={"steps": _plot(trial_figures.steps_figure(t, picks)),
                       "pie": _plot(trial_figures.breakdown_pie(t))})


def _trial_summary(t: dict[str, Any], picks: dict[int, dict[str, Any]]) -> list[tuple[str, str]]:
    """The trial page's (label, text) pairs: what ran, when, what it took to start, and its part in the job's pick."""
    r = t["result"] or {}
    ran = r.get("config") or {}
    timing = r.get("timing") or {}
    items = [("backend", t["backend"]), ("config", _knobs(t["config"])), ("role", str(t["role"]))]
    shape = ", ".join(f"{k} {ran[k]}" for k in ("seq_len", "world_size", "num_layers") if ran.get(k) is not None)
    if shape:
        items.append(("ran", shape + (" (a probe at reduced depth)" if t["config"].get("num_layers") else "")))
    if r.get("nodes"):      # rank by rank: the host, and on a Ray cluster its node's id
        items.append(("on", ", ".join(f"rank {i}: {node}" for i, node in enumerate(r["nodes"]))
                      if len(set(r["nodes"])) > 1 else r["nodes"][0]))
    items.append(("started / finished (UTC)", f"{_ts(t['started_at'])} / {_ts(t['finished_at'])} "
                                              f"({_duration(t['started_at'], t['finished_at'])})"))
    if timing.get("setup_s") is not None:
        items.append(("setup", f"{timing['setup_s']:.1f} s from its fork to its first step; resident memory then "
                               f"{_bytes(timing.get('host_bytes_at_start'))}"))
    for k, v in (r.get("backend_detail") or {}).items():
        items.append((str(k), str(v)))
    entry = picks.get(t["number"])
    if entry:
        which = "the job's pick" if entry.get("trial_number") == t["number"] else \
            f"pooled into the pick of trial #{entry.get('trial_number')}"
        items.append(("in the job's best", f"{which}: {_measured_in(entry)}; its figure "
                                           f"{_num(entry.get('tokens_per_s'))} tokens/s"))
    return items


def _parity_table(t: dict[str, Any]) -> dict[str, Any] | None:
    """The trial page's parity row: both losses, the relative difference (the job page's cell), the tolerance."""
    p = figures.parity_of(t)
    if p is None:
        return None
    return {"loss": _g(p.get("loss"), ".6g"), "reference_loss": _g(p.get("reference_loss"), ".6g"),
            "rel_diff": _g(p.get("rel_diff")), "tolerance": _g(p.get("tolerance")), "ok": bool(p.get("ok"))}


def _config_rows(t: dict[str, Any]) -> list[tuple[str, str]]:
    """Every knob the trial ran with: its stored config, then what its result's config adds (seq_len, world size)."""
    ran = (t["result"] or {}).get("config") or {}
    return [(k, comparing.knob_value(v)) for k, v in {**ran, **t["config"]}.items() if v is not None]


def _throughput(t: dict[str, Any]) -> dict[str, Any]:
    """The trial's figure: the median step's tokens/s, its 95% interval and what stands behind it."""
    r = t["result"] or {}
    timing = r.get("timing") or {}
    ci = timing.get("tokens_per_s_ci95")
    steps = timing.get("steps_s") or []
    return {"tokens_per_s": _num(r.get("tokens_per_s")), "diverged": figures.status_of(t) == "diverged",
            "interval": f"[{_num(ci[0])}, {_num(ci[1])}]" if ci else None,
            "steps": len(steps), "rounds": timing.get("rounds"), "step_s": _num(r.get("step_seconds"), ".4f"),
            "cv": f"{timing['cv']:.1%}" if isinstance(timing.get("cv"), (int, float)) else None,
            "unstable": timing.get("unstable_reasons") or [],
            "others_busy": _num((timing.get("interference") or {}).get("others_busy_cores"), ".1f")}


def _measured_predicted(t: dict[str, Any]) -> dict[str, Any]:
    """The trial's measured figures beside what the job's models predicted for it before it ran (its `predicted`),
    and how far off they were."""
    r, pred = t["result"] or {}, t["predicted"] or {}
    rows = []

    def seconds(v: Any) -> str:
        return _num(v, ".4f")

    for label, key, predicted, show in (
            ("tokens/s", "tokens_per_s", "tokens_per_s", _num),
            ("step seconds", "step_seconds", "step_seconds", seconds),
            # the step-time prior from the machine's rates, corrected by the trials before this one
            ("tokens/s, from calibrated rates", "tokens_per_s", "prior_tokens_per_s", _num),
            ("step seconds, from calibrated rates", "step_seconds", "prior_step_seconds", seconds),
            ("device peak", "peak_device_bytes", "peak_device_bytes", _bytes),
            ("host peak", "peak_host_bytes", "peak_host_bytes", _bytes)):
        if predicted.startswith("prior_") and pred.get(predicted) is None:
            continue            # the job had no rates for this machine (sltune calibrate SPEC stores them)
        m, p = r.get(key), pred.get(predicted)
        off = f"{m / p - 1:+.1%}" if isinstance(m, (int, float)) and isinstance(p, (int, float)) and p > 0 else "-"
        rows.append((label, show(m), show(p), off))
    fits = pred.get("fits")
    verdict = None if fits is None else "predicted to fit" if fits else \
        f"predicted not to fit ({', '.join(map(str, pred.get('over') or [])) or 'over a limit'})"
    shown = ("tokens_per_s", "step_seconds", "prior_step_seconds", "peak_device_bytes", "peak_host_bytes")
    return {"rows": rows, "any": any(pred.get(k) is not None for k in shown),
            "verdict": verdict}


def _breakdown_rows(t: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(category, share of the profiled step, seconds) for each category the step spent time in."""
    shares, secs = figures.breakdown_of(t) or {}, figures.seconds_of(t) or {}
    return [(figures.BREAKDOWN[k], f"{v:.1%}", f"{secs[k] * 1000:,.2f} ms" if k in secs else "-")
            for k, v in shares.items() if v > 0]


def _top_ops(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(operator, calls, self time, share of the profiled step) of the operators the profiler found costliest."""
    wall = r.get("profiled_step_seconds")
    rows = []
    for op in r.get("top_ops") or []:
        s = op.get("self_seconds")
        rows.append((str(op.get("name", "?")), str(op.get("count", "-")),
                     f"{s * 1000:,.2f} ms" if isinstance(s, (int, float)) else "-",
                     f"{s / wall:.1%}" if isinstance(s, (int, float)) and isinstance(wall, (int, float)) and wall
                     else "-"))
    return rows


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


@router.get("/dashboard/machines", response_class=HTMLResponse)
def machines(request: Request) -> HTMLResponse:
    """The rates `sltune calibrate` stored, newest first: each machine's fingerprint, when, and every rate with its
    spread."""
    from sltune.machine import MachineRates

    shown = []
    for row in request.app.state.store.all_rates():
        r = MachineRates.model_validate(row.rates)
        shown.append({"machine": row.machine, "workload": row.workload, "measured": _ts(row.measured_at),
                      "seconds": f"{r.seconds:.1f}", "where": r.where(), "rates": r.shown()})
    return _page("machines.html", "machines", calibrations=shown)


@router.get("/dashboard/compare", response_class=HTMLResponse)
def compare_page(request: Request, a: str | None = None, b: str | None = None,
                 max_regression: str = "5%") -> HTMLResponse:
    store = request.app.state.store
    jobs = store.jobs(limit=200)
    limit = _fraction(max_regression)
    if limit is None:
        return _page("compare.html", "compare", job_a=None, bad_max_regression=max_regression,
                     form=_compare_form(jobs, a, b), status_code=400)
    if not a or not b:
        return _page("compare.html", "compare", job_a=None, bad_max_regression=None,
                     form=_compare_form(jobs, a, b, max_regression) if jobs else None)
    job_a, job_b = store.job(a), store.job(b)
    if job_a is None or job_b is None:
        return _not_found(f"no job {(a if job_a is None else b)!r}")
    try:
        cmp = comparing.compare(comparing.from_store(store, job_a.id), comparing.from_store(store, job_b.id), limit)
    except ValueError as err:          # unfinished, or no successful trial: nothing to compare (CLI exit 2)
        cmp, why = {"rows": [], "best_a": None, "best_b": None}, str(err)
    verdict = None
    if cmp.get("verdict") is not None:
        lo, hi = cmp["ci95"]
        good = cmp["verdict"] != "regression"
        inconclusive = cmp["verdict"] == "inconclusive"
        verdict = {"good": good, "word": cmp["verdict"] if good else "REGRESSION", "ratio": f"{cmp['ratio']:.3f}",
                   "change": f"{cmp['change']:+.1%}", "low": f"{lo:.3f}", "high": f"{hi:.3f}",
                   "allowed_drop": f"{limit:.1%}",
                   # other processes' busy cores while A's and B's bests were measured
                   "busy": [f"{c:.2f}" for c in cmp["busy_elsewhere"]] if inconclusive else None,
                   "interference": "; ".join(cmp["measured_under_interference"])
                   if not inconclusive and cmp["measured_under_interference"] else None}
    # Plotly renders a little HTML in labels: the figure gets the names escaped
    label_a, label_b = (f"A: {html.escape(job_a.name)} ({html.escape(job_a.id)})",
                        f"B: {html.escape(job_b.name)} ({html.escape(job_b.id)})")
    # a row per config and backend: the backend its own column, the config named as the tuner names it
    rows = [{"backend": comparing.backend_of(r["config"]),
             "config": comparing.config_name(r["config"]).removeprefix(comparing.backend_of(r["config"]) + " "),
             "a": _num(r["a"]), "b": _num(r["b"]),
             "regression": r.get("verdict") == "regression", "ratio": _num(r["ratio"], ".3f"),
             "interval": _interval(r.get("ci95")), "verdict": r.get("verdict") or "-"} for r in cmp["rows"]]
    swap = {"a": job_b.id, "b": job_a.id, "max_regression": max_regression}
    active = job_a.status in ACTIVE or job_b.status in ACTIVE
    return _page("compare.html", "compare", plots=True, refresh=15 if active else None,
                 job_a=_side(job_a, cmp["best_a"], cmp.get("best_config_a")),
                 job_b=_side(job_b, cmp["best_b"], cmp.get("best_config_b")), verdict=verdict,
                 why=why if verdict is None else None, max_regression=max_regression, rows=rows,
                 swap=f"/dashboard/compare?{urlencode(swap)}",
                 fig=_plot(figures.compare_figure(cmp, label_a, label_b, limit)),
                 form=_compare_form(jobs, job_a.id, job_b.id, max_regression))


def _side(job, best_tokens_per_s: float | None, best_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """One job's row in the compare page's summary: its best's figure and config (with the backend: two jobs'
    bests may be of different backends)."""
    return {"id": job.id, "qid": _q(job.id), "name": job.name, "status": job.status,
            "best_tokens_per_s": _num(best_tokens_per_s),
            "best_backend": comparing.backend_of(best_config) if best_config else "-",
            "best_config": comparing.config_name(best_config).removeprefix(comparing.backend_of(best_config) + " ")
            if best_config else "-"}


@router.get("/dashboard/{rest:path}", response_class=HTMLResponse)
def unknown_page(rest: str) -> HTMLResponse:
    """Any other page under /dashboard (a trial list without a number, a mistyped path): the dashboard's not-found
    page a browser shows, not the API's JSON 404. Registered last: every page above matches first."""
    return _not_found(f"no dashboard page /dashboard/{rest}")
