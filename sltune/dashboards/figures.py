"""Plotly figure builders: pure functions from a job's data to figures (no database, no web).

A *trial* here is a dict as `GET /jobs/{id}/trials` returns it: number, role, status, config
(sub_batch_size, num_sub_batches, num_live_blocks, ...), result (the TrialResult or None while it
runs), predicted (what the fitted models said before it ran), started_at, finished_at. Its backend
(speedloader, deepspeed, fsdp; issue #33) is its config's or its result's config's, speedloader when
neither names one (trials from before there were backends). Every key may
be missing or None (a running or failed job has partial data): builders skip what they cannot draw
and return None when nothing is left, so the page can say "no data yet" instead of failing.

Strings from users (job names) are HTML-escaped by the caller before they reach a figure: Plotly
renders a small subset of HTML in labels.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Iterable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sltune.backend_knobs import BACKENDS
from sltune.backend_knobs import KNOBS as BACKEND_KNOBS
from sltune.tuning.report.compare import backend_name, config_name, knob_value, normalized, trial_config

# the TrialResult breakdown keys, in drawing order, with their labels and fixed colours
BREAKDOWN = {"compute": "compute", "memcpy": "memcpy", "cpu": "CPU", "all_gather": "all-gather",
             "reduce_scatter": "reduce-scatter", "disk": "disk", "other": "other"}
BREAKDOWN_COLORS = {"compute": "#4c78a8", "memcpy": "#f58518", "cpu": "#54a24b", "all_gather": "#b279a2",
                    "reduce_scatter": "#e45756", "disk": "#9d755d", "other": "#bab0ac"}
STATUS_COLORS = {"ok": "#2ca02c", "oom": "#d62728", "failed": "#7f7f7f", "timeout": "#ff7f0e",
                 "running": "#1f77b4", "interrupted": "#bcbd22",
                 "diverged": "#b00020"}     # its step-1 loss is not plain PyTorch's: measured, never picked
CONFIRM_COLOR = "#9467bd"     # confirmation trials: re-measurements of the finalists, not search steps
LIVE_BLOCK_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b", "#9d755d"]
# each backend's colour and marker where a figure tells them apart (none of the status colours)
BACKEND_COLORS = {"speedloader": "#4c78a8", "deepspeed": "#e377c2", "fsdp": "#17becf"}
BACKEND_SYMBOLS = {"speedloader": "circle", "deepspeed": "square", "fsdp": "triangle-up"}
PIE_LIMIT = 12
FONT = dict(family="system-ui, -apple-system, Segoe UI, sans-serif", size=12)


# -- small accessors that tolerate missing data ----------------------------------------------------
def knobs(trial: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    c = trial.get("config") or (trial.get("result") or {}).get("config") or {}
    return c.get("sub_batch_size"), c.get("num_sub_batches"), c.get("num_live_blocks")


def _config_of(trial_or_config: dict[str, Any]) -> dict[str, Any]:
    """A trial's knobs with its backend's (compare.trial_config), or a config dict as given."""
    if isinstance(trial_or_config.get("config"), dict) or isinstance(trial_or_config.get("result"), dict):
        return trial_config(trial_or_config)
    return trial_or_config


def backend_of(trial_or_config: dict[str, Any]) -> str:
    """"deepspeed": the backend a trial (or a config) ran on; speedloader when it does not say."""
    return str(_config_of(trial_or_config).get("backend") or "speedloader")


def backends_in(trials: Iterable[dict[str, Any]]) -> list[str]:
    """The backends the trials ran on, in the tuner's order (speedloader, deepspeed, fsdp)."""
    seen = {backend_of(t) for t in trials}
    return sorted(seen, key=lambda b: (BACKENDS.index(b) if b in BACKENDS else len(BACKENDS), b))


def config_label(trial_or_config: dict[str, Any]) -> str:
    """"b=2 N=4 k=1" for a trial or a config dict; another backend's leads with it and ends with its knobs
    ("deepspeed b=2 N=4 zero_stage=3 offload_optimizer=cpu offload_param=none"), having no k."""
    c = _config_of(trial_or_config)
    if backend_of(c) != "speedloader":
        return config_name(c)
    return (f"b={c.get('sub_batch_size', '?')} N={c.get('num_sub_batches', '?')} "
            f"k={c.get('num_live_blocks', '?')}")


def tokens_per_s(trial: dict[str, Any]) -> float | None:
    r = trial.get("result") or {}
    v = r.get("tokens_per_s", trial.get("tokens_per_s"))
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def status_of(trial: dict[str, Any]) -> str:
    return str(trial.get("status") or (trial.get("result") or {}).get("status") or "running")


def breakdown_of(trial: dict[str, Any]) -> dict[str, float] | None:
    b = (trial.get("result") or {}).get("breakdown")
    if not isinstance(b, dict):
        return None
    values = {k: float(b.get(k) or 0.0) for k in BREAKDOWN}
    return values if sum(values.values()) > 0 else None


def seconds_of(trial: dict[str, Any]) -> dict[str, float] | None:
    """Seconds per breakdown category of the profiled step: measured ones, else the fractions times the
    profiled step's (or a timed step's) wall time."""
    r = trial.get("result") or {}
    measured = r.get("breakdown_seconds")
    if isinstance(measured, dict) and any(k in measured for k in BREAKDOWN):
        return {k: float(measured.get(k) or 0.0) for k in BREAKDOWN}
    b, wall = breakdown_of(trial), r.get("profiled_step_seconds") or r.get("step_seconds")
    if b is None or not isinstance(wall, (int, float)):
        return None
    return {k: v * wall for k, v in b.items()}


def hover_config(trial: dict[str, Any]) -> str:
    b, n, k = knobs(trial)
    layers = (trial.get("config") or {}).get("num_layers")      # a probe at reduced depth (search.probe_layers)
    what = f"b={b} N={n} k={k}" if backend_of(trial) == "speedloader" else config_label(trial)
    return (f"trial #{trial.get('number', '?')} ({trial.get('role') or '?'})<br>{what}"
            + (f" at {layers} layers" if layers else ""))


def ids(trials: Iterable[dict[str, Any]]) -> list[str]:
    """Each point's id: its trial's number, which the job page's click handler opens the trial page of."""
    return [str(t.get("number", "")) for t in trials]


def picks_of(result: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """The job result's picks (its best, each backend's best) by the number of every trial each one pools: the
    pick's one figure is its entry's tokens_per_s (the median of all those trials' steps), which every place that
    shows the pick shows, never one trial's own."""
    result = result or {}
    out: dict[int, dict[str, Any]] = {}
    for entry in [result.get("best") or {}, *(result.get("best_by_backend") or {}).values()]:
        if isinstance(entry.get("tokens_per_s"), (int, float)):
            for n in [entry.get("trial_number"), *(entry.get("from_trials") or [])]:
                if n is not None:
                    out.setdefault(n, entry)
    return out


def pick_figure(trial: dict[str, Any], picks: dict[int, dict[str, Any]] | None) -> float | None:
    """The trial's pick's figure where it is part of a pick, else its own."""
    entry = (picks or {}).get(trial.get("number"))
    return float(entry["tokens_per_s"]) if entry else tokens_per_s(trial)


def pooled_text(trial: dict[str, Any], picks: dict[int, dict[str, Any]] | None) -> str:
    """"pooled over trials #2, #9" for a pick of several trials, else "trial #2"."""
    numbers = ((picks or {}).get(trial.get("number")) or {}).get("from_trials") or [trial.get("number")]
    return (f"pooled over trials {', '.join(f'#{n}' for n in numbers)}" if len(numbers) > 1
            else f"trial #{numbers[0]}")


def parity_of(trial: dict[str, Any]) -> dict[str, Any] | None:
    """The trial's step-1 loss against plain PyTorch's ({loss, reference_loss, rel_diff, tolerance, ok}), if
    it was checked."""
    p = (trial.get("result") or {}).get("parity")
    return p if isinstance(p, dict) else None


def log_toggle(fig: go.Figure, log: bool = False) -> go.Figure:
    """Buttons that switch every y axis between linear and log: one outlier no longer squashes the rest. They
    sit above the plot's top-left corner: Plotly's mode bar takes the top-right one."""
    axes = [k for k in fig.layout.to_plotly_json() if k.startswith("yaxis")] or ["yaxis"]

    def scale(kind: str) -> dict[str, str]:
        return {f"{a}.type": kind for a in axes} | {f"{a}.autorange": True for a in axes}

    fig.update_layout(updatemenus=[dict(type="buttons", direction="right", x=0.0, xanchor="left", y=1.13,
                                        yanchor="bottom", showactive=True, active=1 if log else 0,
                                        buttons=[dict(label="linear y", method="relayout", args=[scale("linear")]),
                                                 dict(label="log y", method="relayout", args=[scale("log")])])])
    return fig


def base_layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    fig.update_layout(title=dict(text=title, x=0.01, xanchor="left"), height=height, font=FONT,
                      template="plotly_white", margin=dict(l=60, r=30, t=70, b=50))
    return fig


# -- time breakdown ---------------------------------------------------------------------------------
def pie_trials(trials: Iterable[dict[str, Any]], limit: int = PIE_LIMIT) -> tuple[list[dict[str, Any]], int]:
    """The ok trials that have a breakdown, fastest first, at most `limit`; and how many there were."""
    eligible = [t for t in trials if status_of(t) == "ok" and breakdown_of(t) is not None]
    eligible.sort(key=lambda t: (-(tokens_per_s(t) or 0.0), t.get("number") or 0))
    return eligible[:limit], len(eligible)


def breakdown_pies(trials: Iterable[dict[str, Any]], limit: int = PIE_LIMIT, cols: int = 4,
                   picks: dict[int, dict[str, Any]] | None = None) -> go.Figure | None:
    """One pie per ok trial with a breakdown (the fastest `limit`): compute, memcpy, CPU, all-gather,
    reduce-scatter, other, as fractions of the profiled step. The pick's trial (picks_of) is starred and titled
    with the pick's figure, as the Best config table gives it; every other pie with its trial's own."""
    shown, _total = pie_trials(trials, limit)
    if not shown:
        return None
    picked = {e.get("trial_number"): e for e in (picks or {}).values()}
    titles = [f"★ #{t.get('number')} {config_label(t)}<br>{pick_figure(t, picks):,.1f} tok/s, the pick"
              if t.get("number") in picked else
              f"#{t.get('number')} {config_label(t)}<br>{(tokens_per_s(t) or 0):,.0f} tok/s" for t in shown]
    return pie_grid([(t, f"trial #{t.get('number')}") for t in shown], titles, cols,
                    "Time breakdown of the profiled step")


def pie_grid(pies: list[tuple[dict[str, Any], str]], titles: list[str], cols: int, title: str,
             height: int = 250) -> go.Figure:
    """(trial, trace name) pies in rows of `cols`, each titled; a slice per breakdown category the trial spent
    time in, its hover the seconds behind the percentage."""
    cols = max(1, min(cols, len(pies)))
    rows = math.ceil(len(pies) / cols)
    fig = make_subplots(rows=rows, cols=cols, specs=[[{"type": "domain"}] * cols for _ in range(rows)],
                        subplot_titles=titles, vertical_spacing=0.12 / rows + 0.04)
    for i, (t, name) in enumerate(pies):
        b, secs = breakdown_of(t), seconds_of(t) or {}
        keys = [k for k in BREAKDOWN if b[k] > 0]         # an empty slice (all-gather at one rank) says nothing
        fig.add_trace(go.Pie(labels=[BREAKDOWN[k] for k in keys], values=[b[k] for k in keys],
                             marker=dict(colors=[BREAKDOWN_COLORS[k] for k in keys]), sort=False,
                             direction="clockwise", textinfo="percent", textposition="inside",
                             name=name, hole=0.3, meta={"trial": t.get("number")},     # a click opens its page
                             customdata=[f"{secs[k] * 1000:,.1f} ms" if k in secs else "-" for k in keys],
                             hovertemplate="%{label}: %{percent}, %{customdata}<extra>trial #"
                                           + str(t.get("number")) + "</extra>"),
                      row=i // cols + 1, col=i % cols + 1)
    fig.update_annotations(font_size=11)
    fig.update_layout(legend=dict(orientation="h", y=-0.02, yanchor="top", x=0.5, xanchor="center"),
                      uniformtext=dict(minsize=9, mode="hide"))
    return base_layout(fig, title, 130 + height * rows)


# -- the backends side by side (issue #33) ----------------------------------------------------------
def _full_depth_ok(t: dict[str, Any]) -> bool:
    """An ok trial of the model itself: a probe at reduced depth measured a smaller one, never a best."""
    return status_of(t) == "ok" and tokens_per_s(t) is not None and not (t.get("config") or {}).get("num_layers")


def backend_bests(trials: Iterable[dict[str, Any]], result: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Each backend's best trial: the trial of the job result's best_by_backend entry for it (or of the job's
    best, for that best's backend), else the backend's fastest ok trial at full depth. Only an ok trial is ever a
    best: a diverged one was measured but does not train the model correctly."""
    trials = list(trials)
    result = result or {}
    by_number = {t["number"]: t for t in trials if t.get("number") is not None}
    entries = dict(result.get("best_by_backend") or {})
    best = result.get("best") or {}
    if best.get("trial_number") in by_number:
        entries.setdefault(backend_of(by_number[best["trial_number"]]), best)
    out: dict[str, dict[str, Any]] = {}
    for backend in backends_in(trials):
        entry = entries.get(backend) or {}
        picks = [by_number.get(n) for n in [entry.get("trial_number"), *(entry.get("from_trials") or [])]]
        picks = [t for t in picks if t is not None and _full_depth_ok(t) and backend_of(t) == backend]
        if not picks:
            picks = sorted((t for t in trials if backend_of(t) == backend and _full_depth_ok(t)),
                           key=lambda t: (-(tokens_per_s(t) or 0.0), t.get("number") or 0))
        if picks:
            out[backend] = picks[0]
    return out


def backend_pies(trials: Iterable[dict[str, Any]], bests: dict[str, dict[str, Any]], cols: int = 3,
                 picks: dict[int, dict[str, Any]] | None = None) -> go.Figure | None:
    """One pie per backend, side by side (as the SpeedLoader paper's profiling figure): the breakdown of its best
    config, titled with the backend, its knobs and tokens/s (its pick's figure, picks_of). A best trial without a
    breakdown lends its pie to another ok trial of the same config that has one (a confirmation trial); a backend
    with none is left out."""
    trials = list(trials)
    pies = []
    for backend, best in bests.items():
        same = [t for t in trials if _full_depth_ok(t) and breakdown_of(t) is not None
                and config_name(trial_config(t)) == config_name(trial_config(best))]
        t = best if breakdown_of(best) is not None else next(iter(same), None)
        if t is not None:
            pies.append((backend, best, t))
    if not pies:
        return None
    titles = []
    for backend, best, t in pies:
        measured = pooled_text(best, picks)
        if measured != f"trial #{t.get('number')}":
            measured += f"; pie: trial #{t.get('number')}"
        titles.append(f"<b>{backend}</b> · {pick_figure(best, picks) or 0:,.1f} tok/s ({measured})<br>"
                      f"{knob_text(best)}")
    return pie_grid([(t, backend) for backend, _best, t in pies], titles, cols,
                    "Time breakdown of each backend's best config", height=280)


# a tick's short names of another backend's knobs (the hover has them in full)
SHORT_KNOBS = {"zero_stage": "ZeRO-{}", "offload_optimizer": "opt:{}", "offload_param": "param:{}",
               "cpu_offload": "offload:{}", "reshard_after_forward": "reshard:{}"}


def short_label(config: dict[str, Any]) -> str:
    """A config as a tick names it: compare.config_name for SpeedLoader's, "deepspeed b=4 N=2 ZeRO-3 opt:cpu
    param:none" for another backend's (every knob's value, so two configs never share a tick)."""
    if backend_of(config) == "speedloader":
        return config_name(config)
    c = normalized(config)
    return " ".join([c["backend"], f"b={c['sub_batch_size']} N={c['num_sub_batches']}",
                     *([] if c["activations"] in (None, "recompute") else [str(c["activations"])]),
                     *(SHORT_KNOBS.get(k, k + "={}").format(knob_value(c[k]))
                       for k in BACKEND_KNOBS.get(c["backend"], ()))])


def knob_text(trial_or_config: dict[str, Any]) -> str:
    """"b=4 N=2 zero_stage=3 offload_optimizer=cpu offload_param=none": config_label without the backend's name,
    for a place that names it beside (a pie's title, the trials table's backend column)."""
    c = _config_of(trial_or_config)
    if backend_of(c) == "speedloader":
        return config_label(c)
    return " ".join([f"b={c.get('sub_batch_size', '?')} N={c.get('num_sub_batches', '?')}",
                     *backend_name(c).split(" ")[1:]])


def backend_throughput_figure(trials: Iterable[dict[str, Any]], bests: dict[str, dict[str, Any]] | None = None,
                              picks: dict[int, dict[str, Any]] | None = None) -> go.Figure | None:
    """Every trial's tokens/s, one column per backend, each backend's best a star at its pick's figure (picks_of:
    the median of all its trials' steps, beside their own points). A diverged trial (its step-1
    loss is not plain PyTorch's) is a ringed red cross on the zero line, as oom and failed ones are crosses in
    their colours: what it measured is not a throughput of training the model. Probes at reduced depth (a smaller
    model's figures) are left out."""
    trials = [t for t in trials if status_of(t) not in ("running", "interrupted")]
    backends = backends_in(trials)
    column = {b: i for i, b in enumerate(backends)}
    spread: dict[int, float] = {}       # a column's trials across half its width, in trial order: none hides another
    for b in backends:
        same = sorted((t for t in trials if backend_of(t) == b), key=lambda t: t.get("number") or 0)
        for i, t in enumerate(same):
            spread[id(t)] = column[b] + (0.0 if len(same) < 2 else 0.5 * (i / (len(same) - 1) - 0.5))

    def x(group: list[dict[str, Any]]) -> list[float]:
        return [spread[id(t)] for t in group]

    fig = go.Figure()
    ok = sorted((t for t in trials if _full_depth_ok(t)), key=lambda t: t.get("number") or 0)
    for confirm in (False, True):
        sel = [t for t in ok if (t.get("role") == "confirm") == confirm]
        if sel:
            fig.add_trace(go.Scatter(
                x=x(sel), y=[tokens_per_s(t) for t in sel], mode="markers",
                name="confirmation trial" if confirm else "trial", text=[hover_config(t) for t in sel], ids=ids(sel),
                marker=dict(size=9, symbol="diamond" if confirm else "circle",
                            color=CONFIRM_COLOR if confirm else "#4c78a8", line=dict(width=1, color="white")),
                hovertemplate="%{text}<br>%{y:,.1f} tokens/s<extra></extra>"))
    starred = [t for t in (bests or {}).values() if _full_depth_ok(t) and backend_of(t) in column]
    if starred:
        fig.add_trace(go.Scatter(
            x=[spread.get(id(t), column[backend_of(t)]) for t in starred], y=[pick_figure(t, picks) for t in starred],
            mode="markers+text", name="best of its backend", text=[f"{pick_figure(t, picks):,.1f}" for t in starred],
            textposition="top center", cliponaxis=False, ids=ids(starred),
            customdata=[f"{hover_config(t)}<br>{pooled_text(t, picks)}" for t in starred],
            marker=dict(symbol="star", size=18, color="#eeca3b", line=dict(width=1, color="#555")),
            hovertemplate="best: %{customdata}<br>%{y:,.1f} tokens/s<extra></extra>"))
    for status in ("diverged", "oom", "failed", "timeout"):
        bad = [t for t in trials if status_of(t) == status]
        if bad:
            fig.add_trace(go.Scatter(
                x=x(bad), y=[0.0] * len(bad), mode="markers", name=status, cliponaxis=False,
                # diverged: a ringed cross, told apart from an oom's red cross
                marker=dict(symbol="circle-x-open" if status == "diverged" else "x", size=12,
                            color=STATUS_COLORS[status], line=dict(width=2 if status == "diverged" else 0)),
                text=[hover_config(t) + "<br>" + _why_not(t) for t in bad], ids=ids(bad),
                hovertemplate="%{text}<extra>" + status + "</extra>"))
    if not fig.data:
        return None
    fig.update_xaxes(tickvals=list(range(len(backends))), ticktext=backends, range=[-0.6, len(backends) - 0.4],
                     title_text="backend")
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero")
    fig.update_layout(legend=dict(orientation="h", y=-0.22, x=0))
    return log_toggle(base_layout(fig, "Throughput by backend", 420))


def _why_not(trial: dict[str, Any]) -> str:
    """A failed trial's hover: a diverged one's parity (its measured tokens/s only as a note), else its error."""
    p = parity_of(trial)
    if status_of(trial) == "diverged" and p:
        tps = tokens_per_s(trial)
        rel, tol = (f"{v:.2g}" if isinstance(v, (int, float)) else "?" for v in (p.get("rel_diff"), p.get("tolerance")))
        return (f"step-1 loss off plain PyTorch's by {rel} (tolerance {tol})"
                + (f"; ran {tps:,.0f} tokens/s, not counted" if tps else ""))
    return _short((trial.get("result") or {}).get("error"))


# -- throughput against the knobs -------------------------------------------------------------------
def throughput_figure(trials: Iterable[dict[str, Any]], best_number: int | None = None, max_facets: int = 8,
                      picks: dict[int, dict[str, Any]] | None = None) -> go.Figure | None:
    """tokens/s against sub_batch_size, one panel per num_sub_batches, coloured by num_live_blocks;
    confirmation trials as open diamonds beside the search's line; oom / failed / timeout trials as crosses
    on the zero line; the best trial's config a star at its pick's figure (picks_of), beside its trials' own points.
    SpeedLoader's trials only: the knobs are its own (backend_throughput_figure has the rest)."""
    trials = [t for t in trials if all(v is not None for v in knobs(t)) and status_of(t) != "running"
              and backend_of(t) == "speedloader"]
    if not trials:
        return None
    ns = sorted({knobs(t)[1] for t in trials})
    ks = sorted({knobs(t)[2] for t in trials})
    bs = sorted({knobs(t)[0] for t in trials})
    facet = len(ns) <= max_facets
    panels = ns if facet else [None]
    cols = min(len(panels), 4)
    rows = math.ceil(len(panels) / cols)
    titles = [f"num_sub_batches N={n}" for n in panels] if facet else ["marker size: num_sub_batches"]
    fig = make_subplots(rows=rows, cols=cols, shared_yaxes=True, subplot_titles=titles,
                        horizontal_spacing=0.04, vertical_spacing=0.18 if rows > 1 else 0.1)
    seen_legend: set[str] = set()

    def place(n: int | None) -> tuple[int, int]:
        i = panels.index(n) if facet else 0
        return i // cols + 1, i % cols + 1

    for n in panels:
        row, col = place(n)
        in_panel = [t for t in trials if not facet or knobs(t)[1] == n]
        for ci, k in enumerate(ks):
            ok = [t for t in in_panel if knobs(t)[2] == k and status_of(t) == "ok" and tokens_per_s(t)]
            pts = sorted((t for t in ok if t.get("role") != "confirm"), key=lambda t: knobs(t)[0])
            again = [t for t in ok if t.get("role") == "confirm"]
            if again:       # re-measurements of a finalist: beside its search point, not another step of the line
                fig.add_trace(go.Scatter(
                    x=[knobs(t)[0] for t in again], y=[tokens_per_s(t) for t in again], mode="markers",
                    name="confirmation trial", legendgroup="confirm", showlegend="confirm" not in seen_legend,
                    marker=dict(symbol="diamond-open", size=11, line=dict(width=2),
                                color=LIVE_BLOCK_COLORS[ci % len(LIVE_BLOCK_COLORS)]),
                    text=[hover_config(t) for t in again], ids=ids(again),
                    hovertemplate="%{text}<br>%{y:,.1f} tokens/s (confirmation)<extra></extra>"), row=row, col=col)
                seen_legend.add("confirm")
            if not pts:
                continue
            name = f"num_live_blocks k={k}"
            fig.add_trace(go.Scatter(
                x=[knobs(t)[0] for t in pts], y=[tokens_per_s(t) for t in pts], mode="markers+lines",
                name=name, legendgroup=name, showlegend=name not in seen_legend,
                line=dict(color=LIVE_BLOCK_COLORS[ci % len(LIVE_BLOCK_COLORS)], width=1, dash="dot"),
                marker=dict(color=LIVE_BLOCK_COLORS[ci % len(LIVE_BLOCK_COLORS)], line=dict(width=1, color="white"),
                            size=[11 if facet else 7 + 3 * math.log2(max(1, knobs(t)[1])) for t in pts]),
                text=[hover_config(t) for t in pts], ids=ids(pts),
                hovertemplate="%{text}<br>%{y:,.1f} tokens/s<extra></extra>"), row=row, col=col)
            seen_legend.add(name)
        best = [t for t in in_panel if t.get("number") == best_number and status_of(t) == "ok" and tokens_per_s(t)]
        if best:
            fig.add_trace(go.Scatter(
                x=[knobs(best[0])[0]], y=[pick_figure(best[0], picks)], mode="markers", name="the pick",
                ids=ids(best), customdata=[f"{hover_config(best[0])}<br>{pooled_text(best[0], picks)}"],
                marker=dict(symbol="star", size=18, color="#eeca3b", line=dict(width=1, color="#555")),
                hovertemplate="the pick: %{customdata}<br>%{y:,.1f} tokens/s<extra></extra>"), row=row, col=col)
        for status in ("oom", "failed", "timeout", "diverged", "interrupted"):
            bad = [t for t in in_panel if status_of(t) == status]
            if not bad:
                continue
            fig.add_trace(go.Scatter(
                x=[knobs(t)[0] for t in bad], y=[0.0] * len(bad), mode="markers", name=status,
                legendgroup=status, showlegend=status not in seen_legend,
                marker=dict(symbol="x", size=12, color=STATUS_COLORS.get(status, "#444")),
                text=[hover_config(t) + "<br>" + _short((t.get("result") or {}).get("error")) for t in bad],
                ids=ids(bad), hovertemplate="%{text}<extra>" + status + "</extra>"), row=row, col=col)
            seen_legend.add(status)
    fig.update_xaxes(type="log", tickvals=bs, ticktext=[str(b) for b in bs], title_text="sub_batch_size b",
                     title_standoff=4)
    fig.update_yaxes(rangemode="tozero")
    fig.update_yaxes(title_text="tokens/s", col=1)
    return log_toggle(base_layout(fig, "Throughput against the knobs", 150 + 300 * rows))


def _short(text: Any, n: int = 160) -> str:
    s = str(text or "")
    return s if len(s) <= n else s[: n - 1] + "…"


# -- history, importance, parallel coordinates, seconds per trial -------------------------------------
def history_figure(trials: Iterable[dict[str, Any]]) -> go.Figure | None:
    """tokens/s of each trial in the order they ran, and the best so far: how fast the search got there.
    Confirmation trials re-measure the finalists at other moments: they get their own marker and stay out of
    the best-so-far line, which is the search's (a round the machine ran faster would lift it past anything
    the search found); so do probes at reduced depth (search.probe_layers), which measured a smaller model. A job
    over several backends gives each backend's ok trials its colour and marker (open: confirmation trials)."""
    done = sorted((t for t in trials if status_of(t) not in ("running", "interrupted")),
                  key=lambda t: t.get("number") or 0)
    if not done:
        return None
    several = len(backends_in(done)) > 1
    fig = go.Figure()
    for status in ("ok", "oom", "failed", "timeout", "diverged"):
        for backend in backends_in(done) if several and status == "ok" else [None]:
            for confirm in (False, True):
                sel = [t for t in done if status_of(t) == status and (t.get("role") == "confirm") == confirm
                       and backend in (None, backend_of(t))]
                if not sel:
                    continue
                ok = status == "ok"
                if backend is not None:
                    name = f"{backend} confirmation trial" if confirm else f"{backend} trial"
                    marker = dict(color=BACKEND_COLORS.get(backend, "#444"), line=dict(width=2),
                                  symbol=BACKEND_SYMBOLS.get(backend, "circle") + ("-open" if confirm else ""))
                else:
                    name = ("confirmation trial" if confirm else "search trial") if ok else status
                    marker = dict(symbol=("diamond" if confirm else "circle") if ok else "x",
                                  color=CONFIRM_COLOR if ok and confirm else STATUS_COLORS[status])
                fig.add_trace(go.Scatter(
                    x=[t.get("number") for t in sel], y=[tokens_per_s(t) if ok else 0.0 for t in sel],
                    mode="markers", name=name, legendgroup=name, ids=ids(sel),
                    showlegend=ok or not any(tr.name == name for tr in fig.data), text=[hover_config(t) for t in sel],
                    marker=dict(size=10 if ok else 12, **marker),
                    hovertemplate="%{text}<br>" + ("%{y:,.1f} tokens/s" if ok else status) + "<extra></extra>"))
    best, xs, ys = None, [], []
    for t in done:
        if t.get("role") == "confirm" or (t.get("config") or {}).get("num_layers"):    # a smaller model's figure
            continue
        v = tokens_per_s(t) if status_of(t) == "ok" else None
        if v is not None and (best is None or v > best):
            best = v
        if best is not None:
            xs.append(t.get("number"))
            ys.append(best)
    if xs:
        # its steps name their trial as the points do: a click that lands on the line at a trial opens its page
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="best so far (search trials only)",
                                 ids=[str(x) for x in xs], line=dict(color="#d62728", shape="hv"),
                                 hovertemplate="best search trial so far %{y:,.1f} tokens/s<extra></extra>"))
    fig.update_xaxes(title_text="trial #", dtick=1 if len(done) <= 30 else None)
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero")
    fig.update_layout(legend=dict(orientation="h", y=-0.2, x=0))
    return log_toggle(base_layout(fig, "History", 380))


def importance_figure(importances: dict[str, float] | None) -> go.Figure | None:
    """How much each knob explains of tokens/s across the trials (optuna.importance), largest on top."""
    if not importances:
        return None
    items = sorted(importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h",
                           marker_color="#4c78a8", text=[f"{v:.2f}" for _, v in items], textposition="auto",
                           hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_xaxes(title_text="importance for tokens/s (sums to 1)", range=[0, 1])
    return base_layout(fig, "Parameter importance", 110 + 45 * len(items))


def _axis(label: str, values: list[Any], log2: bool = False) -> dict[str, Any]:
    """A parallel-coordinates axis: sizes on a log2 scale, other knobs a tick per value (in their order: the
    backends' order; none, cpu, nvme; false, true). None, a knob of another backend than the trial's, sits on a tick
    "n/a" below the values: Plotly draws no line with a missing value, and a made-up value would read as one the
    trial ran."""
    order = (*BACKENDS, "none", "cpu", "nvme")
    known = sorted({v for v in values if v is not None}, key=lambda v: order.index(v) if v in order else v)
    at: dict[Any, float] = {v: math.log2(v) if log2 else float(i) for i, v in enumerate(known)}
    at[None] = min(at.values(), default=0.0) - 1.0
    ticks = [*([None] if None in values else []), *known]
    return dict(label=label, values=[at[v] for v in values], tickvals=[at[v] for v in ticks],
                ticktext=["n/a" if v is None else knob_value(v) for v in ticks])


def parallel_figure(trials: Iterable[dict[str, Any]]) -> go.Figure | None:
    """Every ok trial as a line through its knobs and tokens/s, coloured by tokens/s: drag an axis to filter. A job
    over several backends has a backend axis, and each backend's own knobs an axis each (k is SpeedLoader's, the
    ZeRO stage and offloads DeepSpeed's, cpu_offload and resharding FSDP's), where another backend's trials are
    "n/a". Every backend has b and N: DeepSpeed's and FSDP's N is their gradient accumulation over b-row
    micro-batches, so b x N rows make a step as SpeedLoader's do."""
    ok = [t for t in trials if status_of(t) == "ok" and tokens_per_s(t) is not None and None not in knobs(t)[:2]]
    if len(ok) < 2:
        return None
    tps = [tokens_per_s(t) for t in ok]
    backends = backends_in(ok)
    configs = [normalized(trial_config(t)) for t in ok]
    dims = [_axis("backend", [c["backend"] for c in configs])] if len(backends) > 1 else []
    for knob, label in (("sub_batch_size", "sub_batch_size b"), ("num_sub_batches", "num_sub_batches N"),
                        *((("num_live_blocks", "num_live_blocks k"),) if "speedloader" in backends else ()),
                        *((k, k) for b in backends for k in BACKEND_KNOBS.get(b, ()))):
        dims.append(_axis(label, [c[knob] for c in configs], log2=knob in ("sub_batch_size", "num_sub_batches",
                                                                             "num_live_blocks")))
    dims.append(dict(label="tokens/s", values=tps))
    fig = go.Figure(go.Parcoords(dimensions=dims, line=dict(color=tps, colorscale="Viridis", showscale=True,
                                                            colorbar=dict(title="tokens/s"))))
    return base_layout(fig, "Parallel coordinates", 400)


def seconds_figure(trials: Iterable[dict[str, Any]]) -> go.Figure | None:
    """Seconds of the profiled step per category, one stacked bar per trial: absolute, so trials compare."""
    rows = sorted(((t, seconds_of(t)) for t in trials if status_of(t) == "ok"), key=lambda r: r[0].get("number") or 0)
    rows = [(t, sec) for t, sec in rows if sec]
    if not rows:
        return None
    # another backend's knobs are too long for a tick: the tick names it and its sizes, the hover all of it
    labels = [f"#{t.get('number')} {config_label(t)}" if backend_of(t) == "speedloader" else
              f"#{t.get('number')} {backend_of(t)} b={knobs(t)[0]} N={knobs(t)[1]}" for t, _ in rows]
    full = [f"#{t.get('number')} {config_label(t)}" for t, _ in rows]
    fig = go.Figure()
    for k, name in BREAKDOWN.items():
        ys = [sec.get(k, 0.0) for _, sec in rows]
        if not any(ys):
            continue                         # a category no trial spent time in stays out of the legend
        fig.add_trace(go.Bar(x=labels, y=ys, name=name, marker_color=BREAKDOWN_COLORS[k], customdata=full,
                             ids=ids(t for t, _ in rows),
                             hovertemplate="%{customdata}<br>" + name + ": %{y:.4f} s<extra></extra>"))
    fig.update_layout(barmode="stack", legend=dict(orientation="h", y=-0.35, x=0))
    fig.update_yaxes(title_text="seconds of the profiled step")
    return log_toggle(base_layout(fig, "Seconds per trial", 430))


# -- timeline ---------------------------------------------------------------------------------------
def _utc(v: Any) -> datetime | None:
    if isinstance(v, str):
        try:
            v = datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            return None
    if not isinstance(v, datetime):
        return None
    if v.tzinfo is not None:
        v = v.astimezone(timezone.utc).replace(tzinfo=None)
    return v


def timeline_figure(trials: Iterable[dict[str, Any]], now: datetime | None = None) -> go.Figure | None:
    """Each trial's start to finish (a running one: to now), coloured by status, labelled with its role; in a job
    over several backends each bar starts with its backend's marker (a legend of its own)."""
    now = _utc(now) or datetime.now(timezone.utc).replace(tzinfo=None)
    rows = []
    for t in trials:
        start = _utc(t.get("started_at"))
        if start is None:
            continue
        end = _utc(t.get("finished_at")) or (now if status_of(t) == "running" else start)
        rows.append((t, start, max(end, start)))
    if not rows:
        return None
    rows.sort(key=lambda r: (r[1], r[0].get("number") or 0))
    labels = [f"#{t.get('number')} {t.get('role') or ''}".strip() for t, _, _ in rows]
    backends = backends_in(t for t, _, _ in rows)
    groups = {"legendgroup": "status", "legendgrouptitle_text": "status"} if len(backends) > 1 else {}
    fig = go.Figure()
    for status in sorted({status_of(t) for t, _, _ in rows}, key=lambda s: list(STATUS_COLORS).index(s)
                         if s in STATUS_COLORS else 99):
        sel = [(lab, t, a, b) for lab, (t, a, b) in zip(labels, rows) if status_of(t) == status]
        fig.add_trace(go.Bar(
            y=[lab for lab, *_ in sel], base=[a.isoformat() for _, _, a, _ in sel], ids=ids(t for _, t, _, _ in sel),
            x=[max((b - a).total_seconds() * 1000.0, 1.0) for *_, a, b in sel], orientation="h", name=status,
            marker=dict(color=STATUS_COLORS.get(status, "#444")), **groups,
            text=[f"{(b - a).total_seconds():.1f}s" for *_, a, b in sel], textposition="inside",
            customdata=[[hover_config(t), f"{(b - a).total_seconds():.1f}",
                         f"{tokens_per_s(t):,.1f} tokens/s" if tokens_per_s(t) and status_of(t) == "ok"
                         else status_of(t)]
                        for _, t, a, b in sel],
            hovertemplate="%{customdata[0]}<br>%{customdata[1]} s<br>%{customdata[2]}<extra></extra>"))
    for backend in backends if groups else []:
        sel = [(lab, t, a) for lab, (t, a, _) in zip(labels, rows) if backend_of(t) == backend]
        fig.add_trace(go.Scatter(
            y=[lab for lab, _, _ in sel], x=[a.isoformat() for _, _, a in sel], mode="markers", name=backend,
            ids=ids(t for _, t, _ in sel), legendgroup="backend", legendgrouptitle_text="backend",
            marker=dict(symbol=BACKEND_SYMBOLS.get(backend, "circle"), color=BACKEND_COLORS.get(backend, "#444"),
                        size=10, line=dict(width=1, color="white")),
            text=[hover_config(t) for _, t, _ in sel], hovertemplate="%{text}<extra>" + backend + "</extra>"))
    fig.update_xaxes(type="date", title_text="time (UTC)")
    fig.update_yaxes(categoryorder="array", categoryarray=labels, autorange="reversed")
    fig.update_layout(barmode="overlay", bargap=0.25, legend=dict(title_text="" if groups else "status"))
    return base_layout(fig, "Trial timeline", 140 + 26 * len(rows))


# -- comparison of two jobs -------------------------------------------------------------------------
def compare_figure(cmp: dict[str, Any], label_a: str = "A", label_b: str = "B",
                   max_regression: float | None = None) -> go.Figure | None:
    """Best tokens/s per config of two jobs side by side (grouped bars), and the change B/A - 1 per config
    with its 95% interval and the allowed drop drawn: `cmp` is what sltune.tuning.report.compare.compare returns."""
    rows = (cmp or {}).get("rows") or []
    if not rows:
        return None
    labels = [short_label(r["config"]) for r in rows]     # every knob: a host and a disk twin are two bars
    names = [config_name(r["config"]) for r in rows]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35], vertical_spacing=0.1,
                        subplot_titles=["best tokens/s per config", "change B vs A per config"])
    for key, name, color in (("a", label_a, "#4c78a8"), ("b", label_b, "#f58518")):
        fig.add_trace(go.Bar(x=labels, y=[r.get(key) for r in rows], name=name, marker_color=color,
                             customdata=names,
                             hovertemplate="%{customdata}<br>%{y:,.1f} tokens/s<extra>" + name + "</extra>"),
                      row=1, col=1)
    changes = [(r["ratio"] - 1.0) if isinstance(r.get("ratio"), (int, float)) else None for r in rows]
    colors = ["#d62728" if r.get("verdict") == "regression" else "#54a24b" for r in rows]
    cis = [r.get("ci95") for r in rows]
    error = None
    if any(cis):     # the 95% interval of each ratio, as error bars on the change
        error = dict(type="data", symmetric=False,
                     array=[(ci[1] - 1.0 - c) if ci and c is not None else 0 for ci, c in zip(cis, changes)],
                     arrayminus=[(c - (ci[0] - 1.0)) if ci and c is not None else 0 for ci, c in zip(cis, changes)])
    fig.add_trace(go.Bar(x=labels, y=changes, name="change", marker_color=colors, showlegend=False, error_y=error,
                         customdata=names, hovertemplate="%{customdata}<br>B vs A %{y:+.1%}<extra></extra>"),
                  row=2, col=1)
    fig.add_hline(y=0.0, line=dict(color="#555", width=1), row=2, col=1)
    if max_regression is not None:
        fig.add_hline(y=-max_regression, line=dict(color="#d62728", dash="dash", width=1), row=2, col=1,
                      annotation_text=f"allowed drop {max_regression:.0%}", annotation_position="bottom right",
                      annotation_font=dict(color="#d62728", size=11))
    fig.update_layout(barmode="group", legend=dict(orientation="h", y=-0.12, x=0))
    fig.update_yaxes(title_text="tokens/s", row=1, col=1)
    spread = max([abs(c) for c in changes if c is not None] + [max_regression or 0.0, 0.05]) * 1.3
    fig.update_yaxes(title_text="B / A − 1", tickformat="+.0%", range=[-spread, spread], row=2, col=1)
    return base_layout(fig, "Throughput per config, side by side", 560)
