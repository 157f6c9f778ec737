"""`sltune plan SPEC.yaml`: every config of a spec with its peaks predicted from the shape alone, before any trial.

No trial runs and no best.yaml is needed: the prior (sltune.tuning.cost.prior) predicts each config's host and device
peaks term by term (and under optimizer_offload or param_offload disk its files' bytes and a step's disk traffic,
formulas of the shape like the rest), the spec's limits (the disk's by default
the free space where trials offload to) (or, with none, this machine's trial ceiling) rule configs in or out with
the tuner's own margin, and each of the largest that fit names the limit that stops it growing. A spec none of
whose configs can fit is refused with every limit the closest config is over, its terms there, and what would fit
(sltune.tuning.cost.feasible), which holds the places on disk the spec does not try to the same disk limit. A disk
limit larger than the free space is named beside it: the spec's own applies as tune would apply it ("the disk limit is
1.0 TiB but only 80.0 GiB is free in DIR: planning with 80.0 GiB"), plan's --disk-limit is a what-if and stands, this
machine's free space said beside it.

Given a machine's rates (`sltune calibrate`, stored or from a file), each config also gets its predicted step time,
tokens/s and breakdown (sltune.tuning.cost.step_time: SpeedLoader's, DeepSpeed's and FSDP's training steps; None
where it does not model the config yet: generation), and the plan names the pick: the fitting config predicted
fastest, whichever backend it is. Rates from another machine's
file make it a what-if of that machine: its device decides how copies overlap compute.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sltune.settings import Settings
from sltune.sizes import format_bytes, parse_bytes
from sltune.tuning.cost.admission import load
from sltune.tuning.cost.baseline import trial_baseline
from sltune.tuning.cost import feasible
from sltune.tuning.cost.feasible import PLAN, FreeSpace, disk_room, shortfall
from sltune.tuning.search.state import SearchState
from sltune.tuning.cost.step_time import MissingRate, StepTime, step_time
from sltune.tuning.spec import DISK_LIMIT_WITHOUT_DISK

if TYPE_CHECKING:
    from sltune.machine.rates import MachineRates

LIMITS = ("device_memory_limit", "host_memory_limit", "disk_limit")


def is_spec(data: Any) -> bool:
    """A tuning spec has a model and none of the sections a best.yaml adds."""
    return isinstance(data, dict) and "model" in data and "resource_models" not in data


def plan_spec(data: dict[str, Any], source: str | Path, device_memory_limit: int | str | None = None,
              host_memory_limit: int | str | None = None, settings: Settings | None = None,
              disk_limit: int | str | None = None, disk_flag: str = "hardware.disk_limit",
              disk_versions: int | None = None, rates: "MachineRates | None" = None,
              rates_from: str | None = None) -> dict[str, Any]:
    """Every config's predicted peaks under the spec's limits (or these), which fit, which limit binds the
    largest, and the refusal when none fits. `disk_flag` names where a `disk_limit` given here came from (plan's
    --disk-limit); `disk_versions`: the disk tier's files as `sltune train --disk-versions` keeps them (plan's
    --disk-versions; not a knob the tuner searches; None: as SpeedLoaderConfig keeps them by default). `rates`: a
    machine's, to predict step times from (`rates_from` says where they came from)."""
    settings = settings or Settings()
    hardware = dict(data.get("hardware") or {})
    asked = {name: hardware.pop(name, None) for name in LIMITS}     # held to below, not refused by the schema
    for name, value in (("device_memory_limit", device_memory_limit), ("host_memory_limit", host_memory_limit),
                        ("disk_limit", disk_limit)):
        if value is not None:
            asked[name] = value
    disk_from = disk_flag if disk_limit is not None else "hardware.disk_limit"
    ok = load({**data, "hardware": hardware}, str(source))
    spec, shape, space = ok.spec, ok.shape, ok.space
    device_limit = None if asked["device_memory_limit"] is None else parse_bytes(
        asked["device_memory_limit"], "hardware.device_memory_limit")
    host_limit = None if asked["host_memory_limit"] is None else parse_bytes(
        asked["host_memory_limit"], "hardware.host_memory_limit")
    disk_asked = None if asked["disk_limit"] is None else parse_bytes(asked["disk_limit"], "hardware.disk_limit")
    host_name = "hardware.host_memory_limit" if host_limit is not None else settings.trial_host_limit_source()
    ceiling = settings.trial_host_limit() if host_limit is None else None
    hw = spec.hardware
    baseline = trial_baseline(hw.device, hw.world_size, spec.workload.mode, hw.cpu_threads, measure=False)
    limited = spec.model_copy(update={"hardware": hw.model_copy(update={"device_memory_limit": device_limit,
                                                                         "host_memory_limit": host_limit,
                                                                         "disk_limit": disk_asked})})
    on_disk = any(c.uses_disk for c in space.candidates)
    if disk_asked is not None and not on_disk:         # as the spec's own check says it (TuningSpec)
        raise ValueError(f"{source}: the disk limit {DISK_LIMIT_WITHOUT_DISK}")
    # what would fit holds the places on disk a spec does not try to the free space too; plan's --disk-limit is a
    # what-if, which stands whatever this machine has free (said beside it)
    what_if = None
    if disk_limit is not None:
        root = settings.offload_root()
        free = feasible.free_bytes(root)
        disk_limit, disk_name = disk_asked, disk_flag
        what_if = (f"{disk_flag}, a what-if: this machine has "
                   f"{'an unknown amount' if free is None else format_bytes(free)} free in {root}")
    else:
        disk_limit, disk_name = disk_room(disk_asked, settings.offload_root(), disk_from)
    state = SearchState(limited, shape, space, baseline=baseline, host_ceiling=ceiling,
                        disk_ceiling=disk_limit if on_disk else None)
    if disk_versions is not None:
        state.recipe = dataclasses.replace(state.recipe, disk_versions=disk_versions)
    preds = {c: state.predict(c) for c in space.candidates}
    fitting = [c for c, p in preds.items() if p.fits]
    largest = [c for c in fitting if not any(o.dominates(c) for o in fitting)]
    times, missing = _step_times(state, rates) if rates is not None else ({}, None)
    timed = [c for c in fitting if times.get(c) is not None]
    timeout = spec.search.trial_timeout_s
    in_time = [c for c in timed if state.trial_seconds_for(times[c], c.backend) <= timeout]
    pick = max(in_time, key=lambda c: times[c].tokens_per_s, default=None)
    out: dict[str, Any] = {
        "source": str(source), "kind": "spec", "model": spec.model.describe(),
        "limits": {"device_memory_limit": device_limit, "host_memory_limit": host_limit or ceiling,
                   "host_limit_from": host_name, "disk_limit": disk_limit if on_disk else None,
                   "disk_limit_from": str(disk_name) if on_disk else None,
                   "disk_limit_note": what_if if on_disk and what_if else (disk_name.overrides() or None)
                   if on_disk and isinstance(disk_name, FreeSpace) else None},
        "margin": spec.search.margin, "trial_baseline_bytes": baseline, "disk_versions": state.recipe.disk_versions,
        "candidates": len(preds), "fitting": len(fitting),
        "configs": [{"config": c.knobs(), "peak_device_bytes": p.device, "peak_host_bytes": p.host,
                     "peak_disk_bytes": p.disk, "fits": p.fits, "over": p.over, **_predicted(times.get(c))}
                    for c, p in sorted(preds.items())],
        "rates": None if rates is None else {"from": rates_from, "machine": rates.where(),
                                             "measured_at": rates.measured_at.isoformat(), "missing": missing},
        "pick": None if pick is None else {"config": pick.knobs(), **_predicted(times[pick]),
                                           "binding_limit": state.binding_limit(pick)},
        "too_slow": len(timed) - len(in_time), "trial_timeout_s": timeout,
        "largest": [{"config": c.knobs(), "binding_limit": state.binding_limit(c),
                     "prior": state.prior(c).to_dict()}
                    for c in sorted(largest, key=lambda c: (-c.batch, -c.sub_batch_size, -(c.num_live_blocks or 0)))],
        "refusal": shortfall(state.recipe, space.candidates, host_limit or ceiling, device_limit, host_name=host_name,
                             disk_limit=disk_limit, disk_name=disk_name, naming=PLAN),
    }
    return out


NOT_PREDICTED = {"predicted_step_s": None, "predicted_step_s_interval": None, "predicted_tokens_per_s": None,
                 "predicted_tokens_per_s_interval": None, "predicted_breakdown": None}


def _predicted(t: StepTime | None) -> dict[str, Any]:
    return NOT_PREDICTED if t is None else t.to_dict()


def _step_times(state: SearchState, rates: "MachineRates") -> tuple[dict[Any, StepTime | None], str | None]:
    """Each config's predicted step on the rates' machine (its device decides how copies overlap compute), and
    what the rates lack where they cannot predict one (None: nothing), said once."""
    recipe = dataclasses.replace(state.recipe, device=rates.device)
    times: dict[Any, StepTime | None] = {}
    missing = None
    for c in state.space.candidates:
        try:
            times[c] = step_time(recipe, c, rates, state.prior(c))
        except MissingRate as err:
            times[c], missing = None, str(err)
    return times, missing
