"""The trial page's figures (/dashboard/jobs/{id}/trials/{n}): its timed steps and the breakdown of its profiled step.

A trial is a dict as figures.py describes it (GET /jobs/{id}/trials); builders return None when the trial has
nothing to draw, so the page can say why.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from sltune.dashboards.figures import base_layout, breakdown_of, pick_figure, pie_grid, pooled_text, status_of
from sltune.profiling.timing import step_tokens_per_s, timing_of


def steps_figure(trial: dict[str, Any], picks: dict[int, dict[str, Any]] | None = None) -> go.Figure | None:
    """Each timed step's tokens/s in the order they ran, the trial's figure (their median) and its 95% interval;
    for a trial its job's pick pools (figures.picks_of), the pick's figure too: the one the job page shows."""
    result = trial.get("result") or {}
    steps = step_tokens_per_s({**result, "status": status_of(trial)})
    if not steps:
        return None
    x = list(range(1, len(steps) + 1))
    fig = go.Figure()
    ci = timing_of(result).get("tokens_per_s_ci95")
    if ci:
        fig.add_hrect(y0=ci[0], y1=ci[1], fillcolor="#4c78a8", opacity=0.15, line_width=0,
                      annotation_text=f"95% interval [{ci[0]:,.1f}, {ci[1]:,.1f}]", annotation_position="top left")
    fig.add_trace(go.Scatter(x=x, y=steps, mode="markers+lines", name="timed step",
                             line=dict(color="#4c78a8", width=1, dash="dot"), marker=dict(size=9, color="#4c78a8"),
                             hovertemplate="step %{x}: %{y:,.1f} tokens/s<extra></extra>"))
    median = result.get("tokens_per_s")
    if isinstance(median, (int, float)):
        fig.add_trace(go.Scatter(x=[x[0], x[-1]], y=[median, median], mode="lines", name="the trial's figure "
                                 "(median step)", line=dict(color="#2ca02c", width=2),
                                 hovertemplate="median %{y:,.1f} tokens/s<extra></extra>"))
    pooled = pooled_text(trial, picks)
    if pooled.startswith("pooled"):
        fig.add_trace(go.Scatter(x=[x[0], x[-1]], y=[pick_figure(trial, picks)] * 2, mode="lines",
                                 name=f"the pick's figure ({pooled})", line=dict(color="#eeca3b", width=2, dash="dash"),
                                 hovertemplate="the pick: %{y:,.1f} tokens/s<extra></extra>"))
    fig.update_xaxes(title_text="timed step", dtick=1 if len(steps) <= 30 else None)
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero")
    fig.update_layout(legend=dict(orientation="h", y=-0.25, x=0))
    return base_layout(fig, "Tokens/s of each timed step", 380)


def breakdown_pie(trial: dict[str, Any]) -> go.Figure | None:
    """The trial's profiled step as one pie (compute, memcpy, CPU, all-gather, reduce-scatter, disk, other), the
    seconds behind each slice on hover; beside it, where the job had the machine's rates, the step the step-time
    prior predicted for it before it ran (`predicted.prior_breakdown`)."""
    if breakdown_of(trial) is None:
        return None
    wall = (trial.get("result") or {}).get("profiled_step_seconds")
    title = f"profiled step: {wall * 1000:,.1f} ms" if isinstance(wall, (int, float)) else "profiled step"
    pies, titles = [(trial, f"trial #{trial.get('number')}")], [title]
    pred = trial.get("predicted") or {}
    if isinstance(pred.get("prior_breakdown"), dict) and isinstance(pred.get("prior_step_seconds"), (int, float)):
        predicted = {"number": trial.get("number"), "result": {"breakdown": pred["prior_breakdown"],
                                                               "step_seconds": pred["prior_step_seconds"]}}
        pies.append((predicted, "predicted"))
        titles.append(f"predicted before it ran: {pred['prior_step_seconds'] * 1000:,.1f} ms")
    return pie_grid(pies, titles, 2, "Time breakdown of the profiled step" + (", measured and predicted"
                                                                            if len(pies) > 1 else ""), height=320)
