"""Server ceilings: no request lifts a resource limit above the server's setting.

Counts and times a request asks for (trials, time budget, trial timeout, timed steps) are refused above
the ceiling: running fewer than asked would change what the job means. Memory limits are lowered to the
ceiling: a lower limit is still one the request's trials respect, and a job naming none gets the
server's. Either way the job records, per limit, what was asked, what applies and whose it is.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sltune.settings import Settings
from sltune.sizes import format_bytes
from sltune.tuning.shape import shape_of
from sltune.tuning.space import SearchSpace
from sltune.tuning.spec import TuningSpec, describe_errors


class Refused(ValueError):
    """The request asks for more than this server allows: one line per field, naming it and the fix."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors      # (field path, message)
        super().__init__("; ".join(f"{f}: {m}" for f, m in errors))


def admit(spec: TuningSpec, settings: Settings) -> tuple[TuningSpec, dict[str, Any]]:
    """The spec as the server will run it, and the record of which limit applies to each resource;
    Refused if it asks for more than the server allows."""
    spec, limits = _memory(spec, settings, _counts(spec, settings))
    biggest = max(c.batch for c in SearchSpace(spec, shape_of(spec.model.source, spec.model.dtype)).candidates)
    tokens = biggest * spec.workload.tokens_per_row
    if tokens > settings.max_tokens_per_step:
        raise Refused([("search", f"the largest config runs {tokens} tokens per step (sub_batch_size*"
                                  f"num_sub_batches*tokens per row), above this server's limit of "
                                  f"{settings.max_tokens_per_step}; lower the largest batch or the sequence length")])
    return spec, limits


def _counts(spec: TuningSpec, settings: Settings) -> dict[str, Any]:
    """Trials, budget, timeout and steps: refused above the ceiling."""
    s = spec.search
    limits: dict[str, Any] = {}
    refused = []
    for field, asked, ceiling in (("search.max_trials", s.max_trials, settings.max_trials),
                                  ("search.time_budget_s", s.time_budget_s, settings.max_time_budget_s),
                                  ("search.trial_timeout_s", s.trial_timeout_s, settings.max_trial_timeout_s),
                                  ("search.trial_steps", s.trial_steps, settings.max_trial_steps)):
        if asked > ceiling:
            refused.append((field, f"{asked:g} is above this server's limit of {ceiling:g}; "
                                   f"ask for at most {ceiling:g}"))
        limits[field] = {"requested": asked, "applied": asked, "by": "request"}
    if refused:
        raise Refused(refused)
    return limits


def _memory(spec: TuningSpec, settings: Settings, limits: dict[str, Any]) -> tuple[TuningSpec, dict[str, Any]]:
    """Host and device memory limits: lowered to the ceiling (a job naming none gets the server's)."""
    hw = spec.hardware
    hardware = {}
    for field, asked, ceiling in (("host_memory_limit", hw.host_memory_limit, settings.trial_host_limit()),
                                  ("device_memory_limit", hw.device_memory_limit, settings.max_device_memory)):
        applied = asked if ceiling is None or (asked is not None and asked <= ceiling) else ceiling
        limits[f"hardware.{field}"] = {"requested": asked, "applied": applied,
                                       "by": "request" if applied == asked else "server"}
        hardware[field] = applied
    if all(hardware[f] == getattr(hw, f) for f in hardware):
        return spec, limits
    data = spec.model_dump(mode="json")
    data["hardware"].update(hardware)
    try:
        return TuningSpec.model_validate(data), limits
    except ValidationError as err:     # the lowered limit is below what the model needs at all
        lowered = ", ".join(f"hardware.{f} to {format_bytes(v)}" for f, v in hardware.items()
                            if v != getattr(hw, f))
        raise Refused([("hardware", f"this server's ceilings lower {lowered}, and then {why}")
                       for why in describe_errors(err)]) from None
