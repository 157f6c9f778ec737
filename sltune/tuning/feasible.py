"""Whether a job can fit its memory limits at all, known from the prior before any trial, and the one line that
refuses it when it cannot.

The least config (the smallest batch, with each of the space's live-block counts, activations, KV placements
and kept shares) is predicted term by term (sltune.tuning.prior). Over a limit, the job is refused before any
trial: the host limit holds all the trial's ranks together (trials enforce it so: more ranks do not bring
more room), the device limit each rank. The line names the limit, what the least config needs term by term,
and what would fit: the recipe changes that bring the need under the limit (no float32 master, SGD without
momentum, bfloat16 weights, the optimizer on disk), or the limit it would take.

Disk is the third resource (search.optimizer_offload: disk keeps the float32 master and the optimizer state in
files): a host limit only disk configs meet is no refusal, they are the job's configs; the job is refused on disk
only when those are the only ones within the host limit and even the least of them is over the disk limit.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
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
    """The config predicted to need the least of `resource` ("host", "device" or "disk"), and its prior."""
    priors = [(c, predict(recipe, c)) for c in smallest(candidates)]
    return min(priors, key=lambda cp: (getattr(cp[1], resource), cp[0]))


def shortfall(recipe: Recipe, candidates: Iterable[Candidate], host_limit: int | None, device_limit: int | None,
              host_name: str = "hardware.host_memory_limit", device_name: str = "hardware.device_memory_limit",
              what: str = "the smallest config", disk_limit: int | None = None,
              disk_name: str = "hardware.disk_limit") -> str | None:
    """None when some least config is predicted within every limit; else one line: the limit, what the least config
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
    if disk_limit is not None:
        least_ones = [(c, predict(recipe, c)) for c in smallest(cands)]
        roomy = [(c, p) for c, p in least_ones if host_limit is None or p.host <= host_limit]
        if roomy and all(recipe.on_disk(c) for c, _ in roomy):
            c, prior = min(roomy, key=lambda cp: (cp[1].disk, cp[0]))
            if prior.disk > disk_limit:
                hosted = [p.host for c2, p in least_ones if not recipe.on_disk(c2)]
                other = (f"; under optimizer_offload host it would need {format_bytes(min(hosted))} in host memory, "
                         f"over {host_name} {format_bytes(host_limit)}" if hosted and host_limit is not None else "")
                return (f"{disk_name} {format_bytes(disk_limit)} is below the {format_bytes(prior.disk)} ({prior.disk} "
                        f"bytes) {what} ({c}) is predicted to need on disk: {listing(prior.disk_terms, prior.disk)}"
                        f"{other}. What would fit: a {disk_name} of at least {format_bytes(prior.disk)} (with "
                        "that much free where trials offload to), or a smaller model")
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
    if train and recipe.schedule != "resident" and not any(recipe.on_disk(c) for c in cands):
        disk = [dataclasses.replace(c, optimizer_offload="disk") for c in cands]
        c, prior = least(recipe, disk, "host")
        if prior.host <= limit:
            fits.insert(0, f"search.optimizer_offload [host, disk] (the master and optimizer state in files: "
                           f"{format_bytes(prior.host)} in host memory, {format_bytes(prior.disk)} on disk)")
    if fits:
        return "; or ".join(fits)
    need = least(recipe, cands, "host")[1].host
    return f"no change of dtype, precision or optimizer; a limit of at least {format_bytes(need)}, or a smaller model"


def disk_room(asked: int | None, root: Path) -> tuple[int | None, str]:
    """The disk limit disk configs are held to, and its name for a refusal: the asked one (hardware.disk_limit), or
    the free space where trials offload to (`root`) when that is less or nothing was asked."""
    free = free_bytes(root)
    if asked is not None and (free is None or asked <= free):
        return asked, "hardware.disk_limit"
    return free, f"the free space in {root}"


def free_bytes(folder: Path) -> int | None:
    """Free bytes on the filesystem `folder` is (or will be) on: its nearest existing ancestor's."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
