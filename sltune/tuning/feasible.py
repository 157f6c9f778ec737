"""Whether a job can fit its memory limits at all, known from the prior before any trial, and the one line that
refuses it when it cannot.

The least config (the smallest batch, with each of the space's live-block counts, activations, KV placements
and kept shares) is predicted term by term (sltune.tuning.prior). Over a limit, the job is refused before any
trial: the host limit holds all the trial's ranks together (trials enforce it so: more ranks do not bring
more room), the device limit each rank. The line names the limit, what the least config needs term by term,
and what would fit: the recipe changes that bring the need under the limit (no float32 master, SGD without
momentum, bfloat16 weights), or the limit it would take.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from sltune.sizes import format_bytes
from sltune.training.optimizer import OptimizerConfig
from sltune.tuning.prior import Prior, Recipe, at_depth, predict
from sltune.tuning.space import Candidate


def smallest(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The configs of the least batch (then the least sub-batch), one per live-block count, activations, KV
    placement and kept share: among them is the one any limit is met by first."""
    cands = list(candidates)
    least = min((c.batch, c.b) for c in cands)
    return [c for c in cands if (c.batch, c.b) == least]


def least(recipe: Recipe, candidates: Iterable[Candidate], resource: str) -> tuple[Candidate, Prior]:
    """The config predicted to need the least of `resource` ("host" or "device"), and its prior."""
    priors = [(c, predict(recipe, c)) for c in smallest(candidates)]
    return min(priors, key=lambda cp: (getattr(cp[1], resource), cp[0]))


def shortfall(recipe: Recipe, candidates: Iterable[Candidate], host_limit: int | None, device_limit: int | None,
              host_name: str = "hardware.host_memory_limit", device_name: str = "hardware.device_memory_limit",
              what: str = "the smallest config") -> str | None:
    """None when the least config is predicted within both limits; else one line: the limit, what the least config
    needs term by term, and what would fit. `what` names the config in the line."""
    cands = list(candidates)
    if device_limit is not None:
        c, prior = least(recipe, cands, "device")
        if prior.device > device_limit:
            return (f"{device_name} {format_bytes(device_limit)} is below the {format_bytes(prior.device)} "
                    f"({prior.device} bytes) {what} ({c}) is predicted to need on the device: "
                    f"{listing(prior.device_terms, prior.device)}; raise it to at least that")
    if host_limit is not None:
        c, prior = least(recipe, cands, "host")
        if prior.host > host_limit:
            return (f"{host_name} {format_bytes(host_limit)} is below the {format_bytes(prior.host)} ({prior.host} "
                    f"bytes) {what} ({c}) is predicted to need in host memory"
                    f"{' (all ranks together)' if recipe.world_size > 1 else ''}: "
                    f"{listing(prior.host_terms, prior.host)}. What would fit: {_would_fit(recipe, cands, host_limit)}")
    return None


def listing(terms: list[tuple[str, int]], total: int) -> str:
    """'the weights in bfloat16 12.6, a float32 master copy 25.1, ... GiB': every term in the total's unit."""
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if total >= s),
                       ("B", 1))
    shown = [f"{what} {n / scale:.1f}" for what, n in terms if round(n / scale, 1)]
    return ", ".join(shown) + f" {unit}"


def _would_fit(recipe: Recipe, cands: list[Candidate], limit: int) -> str:
    """The recipe changes, alone or together, whose least config is predicted within the limit; else the limit
    it would take."""
    from sltune.tuning.shape import shape_of

    changes: list[tuple[str, Recipe]] = []
    sgd = OptimizerConfig(name="sgd")
    train = recipe.mode == "train"
    if train and recipe.master:
        changes.append((f"model.mixed_precision false (one {recipe.shape.dtype} copy, no float32 master)",
                        dataclasses.replace(recipe, mixed_precision=False)))
    if train and recipe.optimizer.state_bytes_per_param():
        changes.append(("optimizer sgd without momentum (no optimizer state)",
                        dataclasses.replace(recipe, optimizer=sgd)))
    if train and recipe.master and recipe.optimizer.state_bytes_per_param():
        changes.append(("model.mixed_precision false and optimizer sgd without momentum",
                        dataclasses.replace(recipe, mixed_precision=False, optimizer=sgd)))
    if recipe.shape.dtype == "float32":
        shape = shape_of(recipe.source, "bfloat16")
        half = dataclasses.replace(recipe, shape=at_depth(shape, recipe.shape.layers)
                                   if recipe.shape.layers < shape.layers else shape)
        changes.append(("model.dtype bfloat16", half))
        if train:
            changes.append(("model.dtype bfloat16 with model.mixed_precision false",
                            dataclasses.replace(half, mixed_precision=False)))
    fits = []
    for what, changed in changes:
        need = least(changed, cands, "host")[1].host
        if need <= limit:
            fits.append(f"{what}: {format_bytes(need)}")
    if fits:
        return "; or ".join(fits)
    need = least(recipe, cands, "host")[1].host
    return f"no change of dtype, precision or optimizer; a limit of at least {format_bytes(need)}, or a smaller model"
