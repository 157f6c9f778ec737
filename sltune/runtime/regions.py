"""Labels on the runtime's phases, so a profile attributes time exactly rather than by op-name guesses.

Every region is "sltune.<category>.<detail>"; the profiler's breakdown maps categories to the slices of
its pie chart: compute (the model's math), memcpy (the runtime's copies), all_gather, reduce_scatter,
cpu (host-side work such as the optimizer on host parameters), disk (the step waiting for the optimizer's files
under optimizer_offload disk, and for the weights' files and the spilled gradients under param_offload disk).
"sltune.step" spans one whole step.
When no profiler runs, a region is a no-op (record_function alone costs ~9 us).
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.profiler import record_function

CATEGORIES = ("compute", "memcpy", "cpu", "all_gather", "reduce_scatter", "disk")
STEP = "sltune.step"
_NULL = contextlib.nullcontext()


def region(category: str, detail: str = "") -> contextlib.AbstractContextManager:
    if not torch.autograd._profiler_enabled():
        return _NULL
    return record_function(f"sltune.{category}.{detail}" if detail else f"sltune.{category}")


def step_region() -> contextlib.AbstractContextManager:
    return record_function(STEP) if torch.autograd._profiler_enabled() else _NULL


def category_of(name: str) -> str | None:
    """The category of a region event's name, or None for anything that is not a region."""
    if not name.startswith("sltune.") or name == STEP:
        return None
    cat = name.split(".", 2)[1]
    return cat if cat in CATEGORIES else None
