"""Server ceilings: no request lifts a resource limit above the server's setting.

Counts and times a request asks for (trials, time budget, trial timeout, timed steps) are refused above
the ceiling: running fewer than asked would change what the job means. Memory limits are lowered to the
ceiling: a lower limit is still one the request's trials respect, and a job naming none gets the
server's. Either way the job records, per limit, what was asked, what applies and whose it is.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sltune.settings import Settings
from sltune.sizes import format_bytes
from sltune.tuning.cost.admission import Admitted, admit
from sltune.tuning.search.trials import machine_cores
from sltune.tuning.spec import MAX_FINALISTS, MAX_WORLD_SIZE, TuningSpec


class Refused(ValueError):
    """The request asks for more than this server allows: one line per field, naming it and the fix."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors      # (field path, message)
        super().__init__("; ".join(f"{f}: {m}" for f, m in errors))


def within_ceilings(ok: Admitted, settings: Settings) -> tuple[TuningSpec, dict[str, Any]]:
    """The admitted spec as the server will run it, and the record of which limit applies to each resource;
    Refused if it asks for more than the server allows. Lowered limits and counts leave its space as it was."""
    spec, limits = _memory(ok.spec, settings, _counts(ok.spec, settings))
    hw = spec.hardware
    candidates = ok.space.candidates
    _fits(replace(ok, spec=spec), limits)
    biggest = max(c.batch for c in candidates)
    tokens = biggest * spec.workload.tokens_per_row * hw.world_size      # every rank runs its own batch
    if tokens > settings.max_tokens_per_step:
        ranks = f"*world_size {hw.world_size}" if hw.world_size > 1 else ""
        raise Refused([("search", f"the largest config runs {tokens} tokens per step (sub_batch_size*"
                                  f"num_sub_batches*tokens per row{ranks}), above this server's limit of "
                                  f"{settings.max_tokens_per_step}; lower the largest batch or the sequence length"
                                  + (" or hardware.world_size" if ranks else ""))])
    threads = max_cpu_threads(hw.world_size)
    if hw.cpu_threads is not None and hw.cpu_threads > threads:
        raise Refused([("hardware.cpu_threads", f"{hw.cpu_threads} is more than this server's {machine_cores()} "
                                                f"cores give each of {hw.world_size} rank(s); ask for at most "
                                                f"{threads}, or leave it unset for all of them")])
    s = spec.search
    most = s.max_trials + MAX_FINALISTS * s.confirm_rounds       # the search's trials, then the confirmation's
    applied = min(most, settings.max_trials)
    limits["trials_in_all"] = {"requested": most, "applied": applied,
                               "by": "request" if applied == most else "server"}
    return spec, limits


def _fits(ok: Admitted, limits: dict[str, Any]) -> None:
    """Refused when the smallest config is predicted over the limits that apply (the server's ceiling where the
    request named none or more), the process a trial runs in counted (sltune.tuning.cost.baseline)."""
    from sltune.tuning.cost.baseline import trial_baseline
    from sltune.tuning.cost.feasible import shortfall

    hw = ok.spec.hardware
    baseline = trial_baseline(hw.device, hw.world_size, ok.spec.workload.mode, hw.cpu_threads, measure=False)
    short = shortfall(ok.with_baseline(baseline), ok.space.candidates, hw.host_memory_limit, hw.device_memory_limit,
                      disk_limit=hw.disk_limit)
    if short:
        field = next((f for f in ("hardware.host_memory_limit", "hardware.disk_limit") if short.startswith(f)),
                     "hardware.device_memory_limit")
        by = (limits.get(field) or {}).get("by")
        raise Refused([(field, ("this server's ceiling applies: " if by == "server" else "") + short)])


def schema_maxima(settings: Settings) -> dict[str, dict[str, float]]:
    """The ceilings JSON schema can state, per spec section and field, for this server's OpenAPI document: a
    spec within them is refused only for what a schema cannot say (a model's max_position_embeddings, the
    tokens of a whole step, what fits in memory)."""
    tokens = settings.max_tokens_per_step
    return {"Search": {"max_trials": settings.max_trials, "time_budget_s": settings.max_time_budget_s,
                       "trial_timeout_s": settings.max_trial_timeout_s, "trial_steps": settings.max_trial_steps,
                       "trial_max_steps": settings.max_trial_steps, "confirm_rounds": settings.max_confirm_rounds},
            "Workload": {"seq_len": tokens, "prompt_len": tokens, "new_tokens": tokens},
            "Hardware": {"cpu_threads": machine_cores(),
                         "world_size": min(max(1, tokens // 2), settings.world_size_ceiling)}}


def max_cpu_threads(world_size: int) -> int:
    """The intra-op threads a trial's rank may ask for: this machine's cores, shared by the ranks."""
    return max(1, machine_cores() // world_size)


def _counts(spec: TuningSpec, settings: Settings) -> dict[str, Any]:
    """Trials, budget, timeout, steps and confirmation rounds: refused above the ceiling."""
    s = spec.search
    limits: dict[str, Any] = {}
    refused = []
    for field, asked, ceiling in (("search.max_trials", s.max_trials, settings.max_trials),
                                  ("search.time_budget_s", s.time_budget_s, settings.max_time_budget_s),
                                  ("search.trial_timeout_s", s.trial_timeout_s, settings.max_trial_timeout_s),
                                  ("search.trial_steps", s.trial_steps, settings.max_trial_steps),
                                  ("search.trial_max_steps", s.trial_max_steps, settings.max_trial_steps),
                                  ("search.confirm_rounds", s.confirm_rounds, settings.max_confirm_rounds),
                                  # this server's machine runs a trial's ranks, or a Ray cluster's nodes do
                                  ("hardware.world_size", spec.hardware.world_size,
                                   settings.world_size_ceiling if spec.hardware.executor == "local" else
                                   MAX_WORLD_SIZE),
                                  # each is at most the tokens of a step, whichever the mode reads (as the
                                  # server's OpenAPI document states)
                                  ("workload.seq_len", spec.workload.seq_len, settings.max_tokens_per_step),
                                  ("workload.prompt_len", spec.workload.prompt_len, settings.max_tokens_per_step),
                                  ("workload.new_tokens", spec.workload.new_tokens, settings.max_tokens_per_step)):
        if field == "search.trial_max_steps" and "trial_max_steps" not in s.model_fields_set:
            continue            # not asked for: the default is lowered to the ceiling instead (_memory)
        if asked > ceiling:
            refused.append((field, f"{asked:g} is above this server's limit of {ceiling:g}; "
                                   f"ask for at most {ceiling:g}"))
        if field.startswith("search."):
            limits[field] = {"requested": asked, "applied": asked, "by": "request"}
    if refused:
        raise Refused(refused)
    return limits


def _memory(spec: TuningSpec, settings: Settings, limits: dict[str, Any]) -> tuple[TuningSpec, dict[str, Any]]:
    """Host and device memory limits: lowered to the ceiling (a job naming none gets the server's); so is the
    default trial_max_steps, when the request names none."""
    hw = spec.hardware
    hardware = {}
    for field, asked, ceiling in (("host_memory_limit", hw.host_memory_limit, settings.trial_host_limit()),
                                  ("device_memory_limit", hw.device_memory_limit, settings.max_device_memory)):
        applied = asked if ceiling is None or (asked is not None and asked <= ceiling) else ceiling
        limits[f"hardware.{field}"] = {"requested": asked, "applied": applied,
                                       "by": "request" if applied == asked else "server"}
        hardware[field] = applied
    search = {}
    if "search.trial_max_steps" not in limits:
        steps = min(spec.search.trial_max_steps, settings.max_trial_steps)
        limits["search.trial_max_steps"] = {"requested": None, "applied": steps,
                                            "by": "request" if steps == spec.search.trial_max_steps else "server"}
        search["trial_max_steps"] = steps
    if all(hardware[f] == getattr(hw, f) for f in hardware) and \
            all(v == getattr(spec.search, f) for f, v in search.items()):
        return spec, limits
    data = spec.model_dump(mode="json")
    data["hardware"].update(hardware)
    data["search"].update(search)
    lowered = TuningSpec.model_validate(data)
    try:
        admit(lowered)
    except ValueError as err:           # the lowered limit is below what the model needs at all
        said = ", ".join(f"hardware.{f} to {format_bytes(v)}" for f, v in hardware.items() if v != getattr(hw, f))
        raise Refused([("hardware", f"this server's ceilings lower {said}, and then {err}")]) from None
    return lowered, limits
