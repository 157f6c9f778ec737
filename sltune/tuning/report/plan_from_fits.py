"""What-if planning: the best config under other memory limits, predicted from a job's fitted models.

No trial runs. The answer says how far to trust it: the models' leave-one-out errors, and every knob
whose value lies outside the range the fits were measured on (an extrapolation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sltune.backend_knobs import KNOBS
from sltune.tuning.cost.admission import load
from sltune.tuning.search.fit import LinearFit, split_key
from sltune.tuning.search.state import SearchState
from sltune.yamlfile import read_yaml


def plan(path: str | Path, device_memory_limit: int | str | None = None,
         host_memory_limit: int | str | None = None) -> dict[str, Any]:
    data = read_yaml(path)
    missing = [k for k in ("resource_models", "search_space", "provenance", "workload") if k not in (data or {})]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)}; plan needs a tuning spec (with a model section) or a "
                         "best-config file a tuning job exported")
    prov, work, limits = data["provenance"], data["workload"], data.get("limits", {})
    hardware = dict(prov["hardware"])
    if device_memory_limit is not None:
        hardware["device_memory_limit"] = device_memory_limit
    if host_memory_limit is not None:
        hardware["host_memory_limit"] = host_memory_limit
    space_desc = data["search_space"]
    if work.get("mode") == "generate":     # a file exported before the knob swept no share: none was kept
        space_desc = {"weights_on_device": [0.0], **space_desc}
    search = {"schedule": data.get("schedule", "speedloader"), "margin": limits.get("margins", {}).get("device", 0.05),
              **{k: v for k, v in space_desc.items()}}
    ok = load({"name": f"plan from {prov.get('job_id')}", "model": prov["model"],
               "workload": {k: v for k, v in work.items() if k != "world_size"},
               "hardware": hardware, "search": search,
               **({"optimizer": data["optimizer"]} if data.get("optimizer") else {})}, str(path))
    spec = ok.spec
    # a file's host model corrects the prior, whose process term is the job's machine's (0 before it was recorded)
    state = SearchState(spec, ok.shape, ok.space, baseline=prov.get("trial_baseline_bytes") or 0)
    state.fits = {k: LinearFit.from_dict(v) for k, v in data["resource_models"].items()}
    state.margins.update(limits.get("margins", {}))
    preds = {c: state.predict(c) for c in state.space.candidates}
    fitting = [c for c, p in preds.items() if p.fits and p.tokens_per_s]

    def own(c) -> list[LinearFit]:
        """The fits of c's backend: another backend's knobs say nothing of c."""
        return [fit for key, fit in state.fits.items() if split_key(key)[0] == c.backend]

    def flags(c) -> list[str]:
        return sorted({name for fit in own(c) for name in fit.extrapolated(state.vars(c))})

    def measured(c) -> bool:
        """Whether a point of its backend's fits is c: the same variables (its knobs), the priors aside."""
        mine = state.vars(c, prior=False)
        return any(all(r["vars"].get(k) == v for k, v in mine.items())
                   for fit in own(c) for r in fit.residuals if "vars" in r)

    # predicted to fit but with no throughput to rank them by: listed, never silently dropped
    unpredictable = [{"config": c.knobs(), "predicted": p.to_dict(), "extrapolated": flags(c), "measured": measured(c),
                      "reason": "the throughput model is not well-posed" if p.step_seconds is None else
                      f"predicted step time {p.step_seconds:.3g}s <= 0: the throughput model fails here"}
                     for c, p in preds.items() if p.fits and not p.tokens_per_s]
    out: dict[str, Any] = {"source": str(path), "job_id": prov.get("job_id"),
                           "limits": {"device_memory_limit": spec.hardware.device_memory_limit,
                                      "host_memory_limit": spec.hardware.host_memory_limit},
                           "candidates": len(preds), "fitting": len(fitting) + len(unpredictable),
                           "unpredictable": unpredictable, "best": None,
                           "leave_one_out_error": {k: _loo(f) for k, f in state.fits.items()}}
    if not fitting:
        out["message"] = ("no config in the search space is predicted to fit these limits" if not unpredictable else
                          "no config predicted to fit has a throughput prediction to rank it by")
        return out
    fitting.sort(key=lambda c: (preds[c].tokens_per_s, c.batch), reverse=True)

    out["configs"] = [{"config": c.knobs(), "predicted": preds[c].to_dict(), "extrapolated": flags(c),
                       "measured": measured(c)} for c in fitting]
    best = fitting[0]
    extrapolated = flags(best)
    was_measured = measured(best)
    out["best"] = {"config": {**best.knobs(), "schedule": spec.search.schedule}, "predicted": preds[best].to_dict(),
                   "binding_limit": state.binding_limit(best), "measured": was_measured}
    summary = (f"extrapolates {', '.join(extrapolated)} beyond the measured range: treat as a first guess"
               if extrapolated else "within the measured range of every knob; " + _expect(out["leave_one_out_error"]))
    if not was_measured:
        summary += "; this config was never measured: confirm it with a trial (sltune profile) before relying on it"
    out["confidence"] = {"extrapolated": extrapolated, "leave_one_out_error": out["leave_one_out_error"],
                         "summary": summary}
    backend = data.get("backend", "speedloader")
    its_knobs = ("num_live_blocks",) if backend == "speedloader" else ("backend", *KNOBS[backend])
    out["measured_best"] = {"config": {k: data[k] for k in ("sub_batch_size", "num_sub_batches", *its_knobs)},
                            "tokens_per_s": data.get("measured", {}).get("tokens_per_s")}
    return out


def _loo(fit: LinearFit) -> dict[str, Any]:
    """A model's leave-one-out errors, or why it has none (too few points, say)."""
    why = fit.to_dict().get("loo_missing")
    return {"typical": fit.loo_typical_error, "max": fit.loo_rel_error, **({"missing": why} if why else {})}


def _expect(loo: dict[str, dict[str, Any]]) -> str:
    """What to expect of the predictions' errors: near the leave-one-out figures, or unknown where a model has
    none."""
    without = [k for k, e in loo.items() if e.get("missing")]
    if not without:
        return "expect errors near the leave-one-out figures"
    which = "the models have" if len(without) == len(loo) else f"the {' and '.join(without)} model(s) have"
    return f"{which} no leave-one-out error: their errors are unknown; confirm the best with a trial"
