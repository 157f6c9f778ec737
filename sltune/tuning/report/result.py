"""A finished job's answer: the best config, its measurements and predictions, the fitted models, which
limit binds, every trial; and the best-config YAML that training jobs read."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sltune.config import SpeedLoaderConfig
from sltune.profiling.timing import timing_of
from sltune.tuning.report.throughput import figure
from sltune.tuning.search.probes import summary
from sltune.tuning.spec import TuningSpec

if TYPE_CHECKING:                   # reading or exporting a stored result needs no cost model (nor torch)
    from sltune.tuning.search.state import SearchState


def job_result(job_id: str, spec: TuningSpec, state: SearchState, stop_reason: str | None,
               wall_seconds: float, confirmation: dict[str, Any] | None = None) -> dict[str, Any]:
    """`confirmation` is confirm.verdict's answer: its winner is the best, its statement the confidence. The
    best's tokens_per_s and interval are its one figure (sltune.tuning.report.throughput) over all its trials.
    best_by_backend holds each backend's best in the same shape (the overall best for its own backend, else that
    backend's fastest search trial), its config naming the backend: what `sltune export --backend B` exports.
    Neither is ever a diverged trial (only ok trials are measured configs)."""
    from sltune.tuning.search.confirm import winner_of

    best = winner_of(state, confirmation)
    several = len(state.space.backends) > 1     # then every config names its backend, SpeedLoader's too
    depth = summary(state)
    models = {k: f.to_dict() for k, f in state.fits.items()}
    for kind, err in (depth or {}).get("full_depth_error", {}).items():
        models[kind]["full_depth_error"] = err      # beside its leave-one-out error: the probes' fit at full depth
    out: dict[str, Any] = {
        "job_id": job_id, "name": spec.name, "strategy": spec.search.strategy, "stop_reason": stop_reason,
        "wall_seconds": wall_seconds, "best": None, "predicted": None, "binding_limit": None,
        "models": models, "depth": depth,
        "margins": state.margins, "space_size": len(state.space.candidates),
        "disk_limit": state.disk_limit if any(c.uses_disk for c in state.space.candidates) else None,
        "trial_baseline_bytes": state.recipe.baseline,      # the host prior's process term: plan needs it again
        "search_space": {**state.space.describe(),      # probe_layers: plan needs the depth terms the fits use
                         **({"probe_layers": spec.search.probe_layers} if depth else {})},
        "confirmation": confirmation,
        "confidence": confirmation["statement"] if confirmation else _unconfirmed(state),
        "step_prior": _step_prior(state),
        "trials": [{"number": d.number, "role": d.role,
                    "config": d.candidate.knobs(named=several),
                    "status": d.result["status"],
                    "tokens_per_s": d.result.get("tokens_per_s"),
                    "tokens_per_s_ci95": timing_of(d.result).get("tokens_per_s_ci95"),
                    "unstable": timing_of(d.result).get("unstable"),
                    "peak_device_bytes": d.result.get("peak_device_bytes"),
                    "peak_host_bytes": d.result.get("peak_host_bytes"), "error": d.result.get("error"),
                    "nodes": d.result.get("nodes"),
                    **({"num_layers": state.depth_of(d)} if state.reduced(d) else {})}
                   for d in sorted(state.history + state.confirms, key=lambda d: d.number)],
    }
    if best is not None:
        out["best"] = _entry(spec, state, best, several)
        out["predicted"] = state.predict(best.candidate).to_dict()
        out["binding_limit"] = state.binding_limit(best.candidate)
    out["best_by_backend"] = {}
    for backend in state.space.backends:
        own = best if best is not None and best.candidate.backend == backend else state.best(backend)
        if own is not None:     # with its own predictions, which export carries for a backend's pick
            out["best_by_backend"][backend] = {**_entry(spec, state, own, named=True),
                                               "predicted": state.predict(own.candidate).to_dict(),
                                               "binding_limit": state.binding_limit(own.candidate)}
    return out


def _step_prior(state: SearchState) -> dict[str, Any] | None:
    """Where the job predicted each trial's step from (the machine's calibrated rates), whether the search was
    guided by it (oneshot's ranking, sltune.tuning.search.strategies) and how far each backend's trials moved that
    prediction (sltune.tuning.cost.correction); None: no rates were stored for this machine."""
    if state.rates is None:
        return None
    return {"rates": state.rates.where(), "measured_at": state.rates.measured_at.isoformat(),
            "guided": state.guided and state.spec.search.strategy == "oneshot",
            "corrections": {b: fix.to_dict() if fix is not None else None for b, fix in state.corrections.items()}}


def _entry(spec: TuningSpec, state: SearchState, pick: Any, named: bool) -> dict[str, Any]:
    """A picked config as the result gives it: its figure over all its trials (search and confirmation), the trials
    it pools and the largest peaks they measured. `named`: its config names its backend (a SpeedLoader config does
    not, in a job of SpeedLoader alone, as before there were backends)."""
    c = pick.candidate
    mine = sorted((d for d in state.history + state.confirms if d.ok and d.candidate == c and not state.reduced(d)),
                  key=lambda d: d.number)
    fig = figure(d.result for d in mine) or {"tokens_per_s": pick.tokens_per_s, "tokens_per_s_ci95": None,
                                             "step_seconds": pick.result.get("step_seconds")}
    schedule = spec.search.schedule if c.backend == "speedloader" else None     # as TrialResult.config has it
    return {"trial_number": pick.number,
            "config": {**c.knobs(named), "schedule": schedule},
            **fig, "from_trials": [d.number for d in mine],
            "search_trials": sum(d.role != "confirm" for d in mine),
            "confirm_trials": sum(d.role == "confirm" for d in mine),
            # the largest each trial of the pick measured: what training must leave room for
            "peak_device_bytes": _peak(mine, "peak_device_bytes"),
            "peak_host_bytes": _peak(mine, "peak_host_bytes")}


def _peak(done: list, key: str) -> int | None:
    return max((d.result[key] for d in done if d.result.get(key) is not None), default=None)


def _unconfirmed(state: SearchState) -> str | None:
    """Why a result has no confirmed statement."""
    if state.best() is None:
        return None
    if len({d.candidate for d in state.history if d.ok and not state.reduced(d)}) < 2:
        return (f"only one config ran successfully{' at full depth' if state.depth else ''}: nothing to compare "
                "it with")
    return "not confirmed: the confirmation round did not finish"


def best_config(spec: TuningSpec, result: dict[str, Any], offload_dir: str | None = None,
                backend: str | None = None) -> SpeedLoaderConfig:
    """The best config as the training job runs it: the overall best, or with `backend` that backend's pick
    (result["best_by_backend"]), naming the backend and its knobs. Under optimizer_offload (or param_offload) disk
    the folder of the optimizer's (and the weights') files (and DeepSpeed's nvme swap folder) is the training job's
    own (`offload_dir`, or `sltune train --offload-dir DIR`): without one the config says disk (nvme) and names no
    folder, as best.yaml does (the tuning machine's folders were its trials' and are gone), and
    SpeedLoaderConfig.from_yaml asks for one."""
    from sltune.backends.export import backend_of, pick
    from sltune.backend_knobs import KNOBS

    if not result.get("best"):
        raise ValueError(f"job {result.get('job_id')} has no best config (status: no successful trial)")
    entry = pick(result, backend)
    c = entry["config"]
    if backend_of(entry) != "speedloader":    # its knobs; SpeedLoader's own (live blocks, schedule) at their only value
        knobs = {k: c[k] for k in KNOBS[backend_of(entry)] if c.get(k) is not None}
        nvme = {k: v for k, v in knobs.items() if v == "nvme"}     # DeepSpeed's swap folder: as disk's, the job's own
        cfg = SpeedLoaderConfig(backend=backend_of(entry), sub_batch_size=c["sub_batch_size"],
                                num_sub_batches=c["num_sub_batches"], activations=c.get("activations", "recompute"),
                                **{k: v for k, v in knobs.items() if k not in nvme},
                                device=spec.hardware.device, dtype=spec.model.dtype,
                                mixed_precision=spec.model.mixed_precision,
                                device_memory_limit=spec.hardware.device_memory_limit,
                                world_size=spec.hardware.world_size)
        if nvme and offload_dir is not None:
            return cfg.replace(**nvme, offload_dir=offload_dir)
        return cfg.model_copy(update=nvme) if nvme else cfg
    cfg = SpeedLoaderConfig(sub_batch_size=c["sub_batch_size"], num_sub_batches=c["num_sub_batches"],
                             num_live_blocks=c["num_live_blocks"], schedule=c["schedule"],
                             activations=c.get("activations", "recompute"),
                             kv_cache=c.get("kv_cache", "host"),
                             weights_on_device=c.get("weights_on_device", 0.0),
                             device=spec.hardware.device, dtype=spec.model.dtype,
                             mixed_precision=spec.model.mixed_precision,
                             device_memory_limit=spec.hardware.device_memory_limit,
                             world_size=spec.hardware.world_size)
    places = {knob: "disk" for knob in ("optimizer_offload", "param_offload") if c.get(knob, "host") == "disk"}
    if places:
        if offload_dir is not None:
            return cfg.replace(**places, offload_dir=offload_dir)
        return cfg.model_copy(update={**places, "offload_dir": None})
    return cfg


def export_yaml(spec: TuningSpec, result: dict[str, Any], path: str | Path | None = None,
                backend: str | None = None) -> str:
    """The best config (with `backend`, that backend's pick) with what it measured, what the models predicted, the
    models and its provenance. The predictions and binding limit are the overall best's: a backend's pick other
    than it carries its own when the result has them, else none."""
    from sltune import __version__
    from sltune.backends.export import pick

    cfg = best_config(spec, result, backend=backend)
    best = pick(result, backend)
    overall = best["trial_number"] == result["best"]["trial_number"]
    return cfg.to_yaml(
        path,
        workload={**spec.workload.model_dump(), "world_size": spec.hardware.world_size},
        optimizer=spec.optimizer.to_dict(),      # what the trials stepped with: `sltune train` reads it
        measured={k: best.get(k) for k in ("tokens_per_s", "tokens_per_s_ci95", "step_seconds", "peak_device_bytes",
                                           "peak_host_bytes", "from_trials")},
        confidence=result.get("confidence") if overall else best.get("confidence"),
        predicted=result["predicted"] if overall else best.get("predicted"),
        limits={"device_memory_limit": spec.hardware.device_memory_limit,
                "host_memory_limit": spec.hardware.host_memory_limit,
                **({"disk_limit": result.get("disk_limit")} if result.get("disk_limit") is not None else {}),
                "margins": result["margins"]},
        binding_limit=result["binding_limit"] if overall else best.get("binding_limit"),
        resource_models=result["models"],
        search_space=result["search_space"],
        provenance={"job_id": result["job_id"], "job_name": spec.name, "strategy": result["strategy"],
                    "trial_number": best["trial_number"], "trials": len(result["trials"]),
                    "model": spec.model.model_dump(exclude_none=True), "hardware": spec.hardware.model_dump(),
                    "trial_baseline_bytes": result.get("trial_baseline_bytes"),
                    "sltune_version": __version__, "created_at": datetime.now(timezone.utc).isoformat()},
    )
