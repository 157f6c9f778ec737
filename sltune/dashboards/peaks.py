"""The job page's measured peaks against the fitted memory models (SpeedLoader's: the models are of its memory).

A trial is a dict as figures.py describes it. The fits' variables need the job's model shape, which imports torch
and transformers: the API process loads them only when a page first draws this figure.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sltune.dashboards.figures import backend_of, base_layout, hover_config, knobs, status_of

MIB = 1024 * 1024


def _mib(v: Any) -> float | None:
    return float(v) / MIB if isinstance(v, (int, float)) and v > 0 else None


def _fmt_bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, size in (("GiB", 1024 ** 3), ("MiB", MIB), ("KiB", 1024)):
        if v >= size:
            return f"{v / size:.1f} {unit}"
    return f"{v:.0f} B"


Variables = Callable[[dict[str, Any]], dict[str, float]]


def job_variables(spec: dict[str, Any] | None) -> Variables | None:
    """A trial config's variables as the job's fits saw them (sltune.tuning.search.fit.variables under the job's
    model shape and tokens per row); None when the spec cannot say."""
    from sltune.tuning.search.fit import variables
    from sltune.tuning.cost.shape import shape_of
    from sltune.tuning.space import Candidate
    from sltune.tuning.spec import ModelSpec, Workload

    try:
        model = ModelSpec.model_validate(spec["model"])
        tokens = Workload.model_validate(spec.get("workload") or {}).tokens_per_row
        shape = shape_of(model.source, model.dtype)     # in a child of the fork server: no torch in this process
    except (TypeError, KeyError, ValueError):
        return None
    return lambda config: variables(Candidate.from_knobs(config), shape, tokens)


def _model_predict(model: dict[str, Any] | None, trial: dict[str, Any], at: Variables | None) -> float | None:
    """What the job's final fit predicts for a trial that is not among its residuals (an oom, say)."""
    from sltune.tuning.search.fit import FEATURES

    if at is None or not model or not model.get("coef") or len(model["coef"]) != len(model.get("features") or []):
        return None
    known = 0.0
    if model.get("offset"):     # a fit of what trials measure beyond a known term: the prior the trial was given
        known = (trial.get("predicted") or {}).get(f"{model['offset']}_bytes")
        if known is None:
            return None
    try:
        v = at(trial.get("config") or {})
        return float(known + sum(c * FEATURES[f](v) for c, f in zip(model["coef"], model["features"])))
    except (KeyError, TypeError, ValueError, ArithmeticError):
        return None


def peaks_figure(models: dict[str, Any] | None, trials: Iterable[dict[str, Any]],
                 limits: dict[str, int | None] | None = None, spec: dict[str, Any] | None = None) -> go.Figure | None:
    """Measured device and host peaks against what the fitted models predict, with each limit drawn.

    Filled circles: the job's (final or latest) fit on the trials it was fitted to (its residuals).
    Crosses: trials the fit did not use (oom ones), predicted by the same fit (given the job's spec, which
    the fit's variables need). Open diamonds: what the models predicted for a trial before it ran (the
    trial's `predicted`), where there was a prediction. SpeedLoader's trials only: the models are of its memory,
    another backend's peaks are measured only."""
    models = models or {}
    limits = limits or {}
    trials = [t for t in trials if backend_of(t) == "speedloader"]
    by_knobs = {knobs(t): t for t in trials}
    at = job_variables(spec)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["device peak", "host peak"], horizontal_spacing=0.1)
    drawn = False
    in_legend: set[str] = set()

    def legend(group: str) -> bool:
        first = group not in in_legend
        in_legend.add(group)
        return first

    for col, kind in ((1, "device"), (2, "host")):
        key = f"peak_{kind}_bytes"
        model = models.get(kind) or {}
        fit_x, fit_y, fit_text = [], [], []
        used = set()
        for r in model.get("residuals") or []:
            v = r.get("vars") or {}
            kn = (v.get("b"), v.get("N"), v.get("k"))
            x, y = _mib(r.get("predicted")), _mib(r.get("measured"))
            if x is None or y is None:
                continue
            used.add(kn)
            t = by_knobs.get(kn, {"config": {"sub_batch_size": kn[0], "num_sub_batches": kn[1],
                                             "num_live_blocks": kn[2]}})
            fit_x.append(x)
            fit_y.append(y)
            rel = r.get("rel_error")
            fit_text.append(hover_config(t) + (f"<br>error {rel:+.1%}" if isinstance(rel, (int, float)) else ""))
        other_x, other_y, other_text, prior_x, prior_y, prior_text = [], [], [], [], [], []
        for t in trials:
            measured = _mib((t.get("result") or {}).get(key, t.get(key)))
            if measured is None:
                continue
            if knobs(t) not in used:
                x = _mib(_model_predict(model, t, at))
                if x is not None:
                    other_x.append(x)
                    other_y.append(measured)
                    other_text.append(hover_config(t) + f"<br>{status_of(t)}")
            before = _mib((t.get("predicted") or {}).get(key))
            if before is not None:
                prior_x.append(before)
                prior_y.append(measured)
                prior_text.append(hover_config(t) + f"<br>{status_of(t)}")
        for xs, ys, text, name, group, marker in (
                (fit_x, fit_y, fit_text, "trials the fit used", "fit", dict(size=9, color="#4c78a8")),
                (other_x, other_y, other_text, "other trials (oom)", "other",
                 dict(size=11, symbol="x", color="#d62728")),
                (prior_x, prior_y, prior_text, "predicted before the trial ran", "prior",
                 dict(size=10, symbol="diamond-open", color="#f58518", line=dict(width=2)))):
            if xs:
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=name, legendgroup=group,
                                         showlegend=legend(group), text=text, marker=marker,
                                         hovertemplate="%{text}<br>predicted %{x:.2f} MiB<br>measured %{y:.2f} MiB"
                                                       "<extra></extra>"), row=1, col=col)
        xs, ys = fit_x + other_x + prior_x, fit_y + other_y + prior_y
        if not xs:
            continue
        drawn = True
        limit = _mib(limits.get(kind))
        lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.25     # the data's range: a far limit must not squash it
        if limit and limit <= 2 * max(xs + ys):
            hi = max(hi, limit * 1.15)                          # a near limit is drawn as a line
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="measured = predicted",
                                 legendgroup="diag", showlegend=legend("diag"), hoverinfo="skip",
                                 line=dict(color="#999", dash="dash", width=1)), row=1, col=col)
        if limit:
            label = f"{kind} limit {_fmt_bytes(limits[kind])}"
            if limit <= hi:
                fig.add_trace(go.Scatter(x=[lo, hi], y=[limit, limit], mode="lines", name="memory limit",
                                         legendgroup="limit", showlegend=legend("limit"),
                                         line=dict(color="#d62728", width=2),
                                         hovertemplate=label + "<extra></extra>"), row=1, col=col)
            else:
                label += f": {limit / max(ys):,.1f}x the largest measured peak, above the plot"
            fig.add_annotation(x=math.log10(lo), y=math.log10(min(limit, hi)), xref=f"x{col if col > 1 else ''}",
                               yref=f"y{col if col > 1 else ''}", text=label, showarrow=False, xanchor="left",
                               yanchor="bottom" if limit <= hi else "top", font=dict(color="#d62728", size=11))
        fig.update_xaxes(type="log", range=[math.log10(lo), math.log10(hi)], title_text="predicted (MiB)",
                         row=1, col=col)
        fig.update_yaxes(type="log", range=[math.log10(lo), math.log10(hi)], title_text="measured (MiB)",
                         row=1, col=col)
    if not drawn:
        return None
    fig.update_layout(legend=dict(orientation="h", y=-0.22, x=0))
    return base_layout(fig, "Measured peaks against the fitted models", 470)
