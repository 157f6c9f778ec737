"""Probes at reduced depth (search.probe_layers): the model's own widths with fewer decoder layers.

A trial runs every layer, and at real depth on a CPU a step takes seconds to minutes, so the probes alone of
a search can take hours. The one-shot method's premise is that cost is linear in the knobs; it is linear in
depth too, so oneshot's probes may run Lp < L layers and the fits take the layer count as a variable. Each
term of the models has a depth scaling known from the shape (sltune.tuning.search.fit's features):

- per layer, through the parameter bytes P = embedding + head + L*layer: a step's parameter loads, gradient
  offloads and optimizer step ("P" in the step time);
- per layer through the compute weights F = head + L*layer: a token's work ("F*N*b*s");
- per group, G = ceil(L/k) ("G", "N*G"), and per layer below the last group ("(L-k)" terms);
- not at all: per sub-batch ("N").

The peaks start from the prior (sltune.tuning.cost.prior) computed at the trial's own depth: the weights, master,
gradients and optimizer state of L layers, the activations at every group edge, term by term; the device's
fitted residual does not depend on L (it holds one or two groups of k layers whatever L is), and the host's is a
constant. So probes at a single depth fix every coefficient, and a full-depth prediction is the same fit at L.
The probe depth must leave the terms apart as at full depth: at least two groups of the largest k (G > 1 for
every probe, and L-k > 0). Frontier and confirmation trials run the whole model; the probes' own fits are then checked
against them (full_depth_error), which is how far to trust a reduced-depth search. The depth of the next probe is
the search state's to say (SearchState.probe_layers), as the fits it keeps depend on it; this module reports on it.

`auto` reduces depth only when a full-depth probe would be slow: the first probe runs at the least depth (when
that is at most half the model), and if its step time scaled to full depth (times L/Lp, an upper bound) is at
least AUTO_STEP_S, every probe runs at that depth; otherwise the rest run the whole model and that one probe is
left out of the fits (a whole-model probe costs a few seconds then, and nothing is extrapolated).
"""

from __future__ import annotations

from statistics import median
from typing import TYPE_CHECKING, Any

from sltune.tuning.search.state import layers_of

if TYPE_CHECKING:
    from sltune.tuning.search.state import SearchState


def full_depth_error(state: "SearchState") -> dict[str, dict[str, Any]]:
    """How well the probes' own fits (reduced-depth trials only) predicted every full-depth trial, search and
    confirmation: per model, the median and largest relative error and how many trials; empty when there are
    no reduced-depth probes or no full-depth trial yet."""
    probes = [d for d in state.history if d.ok and state.reduced(d)]
    full = [d for d in state.history + state.confirms if d.ok and not state.reduced(d)]
    if not probes or not full:
        return {}
    out = {}
    for kind, fit in state.fit(probes).items():
        target = fit.target
        errs = []
        for d in full:
            pred, measured = fit.predict(state.vars(d.candidate)), d.result.get(target)
            if pred is not None and measured:
                errs.append((pred - measured) / measured)
        if errs:
            out[kind] = {"typical": median(abs(e) for e in errs), "max": max(abs(e) for e in errs),
                         "bias": median(errs), "n": len(errs), "probes": fit.n}
    return out


def summary(state: "SearchState") -> dict[str, Any] | None:
    """What the job result says about depth: asked and ran, and the probes' fits' full-depth error."""
    wanted = state.spec.search.probe_layers
    if wanted is None:
        return None
    ran = sorted({layers_of(d) for d in state.history if state.reduced(d)})
    out = {"probe_layers": wanted, "layers": state.shape.layers, "probes_ran_at": ran,
           "reduced": state.probe_layers() is not None, "full_depth_error": full_depth_error(state)}
    first = next((d for d in state.history if d.ok and state.reduced(d)), None)
    if wanted == "auto" and first is not None:      # what auto decided by
        out["first_probe_full_depth_step_s"] = state.full_depth_step(first)
    return out
