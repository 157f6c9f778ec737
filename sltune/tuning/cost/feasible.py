"""Whether a job can fit its limits at all, known from the prior before any trial, and the one answer that
refuses it when it cannot.

The least configs (the smallest batch, with each of the space's live-block counts, activations, KV placements, kept
shares and offload places) are predicted term by term (sltune.tuning.cost.prior). When none of them is within every
limit, the job is refused before any trial: the host limit holds all the trial's ranks together (trials enforce it so:
more ranks do not bring more room), the device limit each rank, the disk limit the files of search.optimizer_offload and
search.param_offload disk (a host config needs none). The answer names every limit the closest config is over, each with
what that config needs term by term, so that raising them all is enough: a user who follows it is not refused again for
another resource. The closest config is the one over the fewest bytes of device memory, then of host memory, then of
disk (the scarcest first); the other configs that need less of some limit (under the optimizer in host memory, say,
where disk configs need disk too) follow with what they would need instead. Then
what would fit: the recipe changes that bring some least config within every limit (the optimizer on disk, the
weights on disk too, no float32 master, SGD without momentum, bfloat16 weights), and the limits each closest config
takes; then a place on disk the spec does not try that only the disk limit stops, with the disk it takes. The spec's
own check predicts without the trial process (it is the machine's that runs the trials): its host figures say so,
and `sltune plan` gives them with it.

A job sweeping several backends (search.backend) is refused when any one of them has no config within every limit:
the user asked to profile each, so a backend that could not run a single trial is said before any, named, with
its answer (raising its limits, or dropping it from search.backend). A wrapped backend's prior is what its trials
allocate (sltune.tuning.cost.wrapped), which says how far trials measured from it.

Disk is the third resource: a host limit only disk configs meet is no refusal, they are the job's configs. The
disk limit is hardware.disk_limit, or the free space where trials offload to when that is less or none was asked
(disk_room): the answer names the free space, and a larger hardware.disk_limit it overrides. The configs a spec
would have on disk (what would fit) are held to the same disk limit, tried or not.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Iterable

from sltune.sizes import format_bytes
from sltune.training.optimizer import OptimizerConfig
from sltune.tuning.cost.prior import Prior, at_depth, predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.space import Candidate

RESOURCES = ("device", "host", "disk")      # the scarcest first: the closest config is over the least of it
WHERE = {"device": "on the device", "host": "in host memory", "disk": "on disk"}
ALTERNATIVES = 2                            # other closest configs an answer names beside the first


class FreeSpace(str):
    """The disk limit's name when it is the free space where trials offload to: passed on as any limit's name is,
    it also knows its folder, the free bytes and the disk limit it overrides (hardware.disk_limit, or plan's
    --disk-limit), so a refusal can say which applies."""

    root: Path
    asked: int | None
    free: int | None
    asked_name: str

    def __new__(cls, root: Path, asked: int | None = None, free: int | None = None,
                asked_name: str = "hardware.disk_limit") -> "FreeSpace":
        name = super().__new__(cls, f"the free space in {root}")
        name.root, name.asked, name.free, name.asked_name = root, asked, free, asked_name
        return name

    def overrides(self) -> str:
        """'hardware.disk_limit is 1.0 TiB but only 80.0 GiB is free in DIR: planning with 80.0 GiB', or '' when no
        larger limit was asked."""
        if self.asked is None:
            return ""
        free = "the free space" if self.free is None else format_bytes(self.free)
        return (f"{self.asked_name} is {format_bytes(self.asked)} but only {free} is free in {self.root}: "
                f"planning with {free}")

    def applies(self) -> str:
        """'hardware.disk_limit 500.0 GiB is more than is free there: the free space applies', or '': said beside
        the free space already named."""
        return (f"{self.asked_name} {format_bytes(self.asked)} is more than is free there: the free space applies"
                if self.asked is not None else "")


@dataclasses.dataclass(frozen=True)
class Limit:
    """One resource's limit as an answer names it."""

    resource: str
    size: int
    name: str

    def said(self, first: bool = True) -> str:
        """'hardware.host_memory_limit 20.0 GiB', or 'the 77.8 GiB free in DIR' (with, `first` time, that it applies
        over a larger hardware.disk_limit)."""
        if not isinstance(self.name, FreeSpace):
            return f"{self.name} {format_bytes(self.size)}"
        why = self.name.applies() if first else ""
        return f"the {format_bytes(self.size)} free in {self.name.root}" + (f" ({why})" if why else "")

    def raised(self, need: int) -> str:
        """What the limit takes for `need`: 'a hardware.disk_limit of at least 150.6 GiB (with that much free ...)'."""
        if isinstance(self.name, FreeSpace):
            return f"at least {format_bytes(need)} free in {self.name.root}"
        named = self.name if self.name.startswith(("hardware.", "--")) else f"{self.resource} limit"
        return (f"a {named} of at least {format_bytes(need)}"
                + (" (with that much free where trials offload to)" if self.resource == "disk" else ""))


@dataclasses.dataclass(frozen=True)
class Naming:
    """How a refusal names what would fit: as a spec's fields (tune, plan, POST /tune) or as the flags of the command
    that was refused (profile), so the fix can be pasted where the mistake was made."""

    optimizer_disk: str = "search.optimizer_offload [host, disk]"
    param_disk: str = "search.param_offload [host, disk]"
    no_master: str = "model.mixed_precision false"
    sgd: str = "optimizer sgd without momentum"
    bf16: str = "model.dtype bfloat16"
    disk_versions: str | None = None    # one version of the disk tier's files, where the command takes it


SPEC = Naming()
FLAGS = Naming("--optimizer-offload disk", "--param-offload disk", "--no-mixed-precision",
               "--optimizer sgd (--momentum 0)", "--dtype bfloat16", "--disk-versions 1")
PLAN = dataclasses.replace(SPEC, disk_versions="--disk-versions 1")     # plan: the spec's fields, and its flag


@dataclasses.dataclass(frozen=True)
class Over:
    """A least config, its prior, and each limit it is over with what it needs there."""

    config: Candidate
    prior: Prior
    over: tuple[tuple[Limit, int], ...]

    def excess(self) -> tuple[int, ...]:
        """The bytes over each limit, scarcest resource first: the closest config has the least."""
        by = {limit.resource: need - limit.size for limit, need in self.over}
        return tuple(by.get(r, 0) for r in RESOURCES)

    def needs_no_more_than(self, other: "Over") -> bool:
        """Every limit this config needs raised, the other needs raised at least as far."""
        theirs = {limit.resource: need for limit, need in other.over}
        return all(need <= theirs.get(limit.resource, -1) for limit, need in self.over)


def smallest(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The configs of the least batch (then the least sub-batch), one per live-block count, activations, KV
    placement, kept share and offload place: among them is the one any limit is met by first."""
    cands = list(candidates)
    least = min((c.batch, c.sub_batch_size) for c in cands)
    return [c for c in cands if (c.batch, c.sub_batch_size) == least]


def shortfall(recipe: Setup, candidates: Iterable[Candidate], host_limit: int | None, device_limit: int | None,
              host_name: str = "hardware.host_memory_limit", device_name: str = "hardware.device_memory_limit",
              what: str = "the smallest config", disk_limit: int | None = None,
              disk_name: str = "hardware.disk_limit", naming: Naming = SPEC) -> str | None:
    """None when some least config is predicted within every limit; else one answer: every limit the closest
    config is over, what it needs there term by term, what the next closest would need instead, and what would
    fit. `what` names the config in the answer, `naming` the changes (a spec's fields unless told: FLAGS for a
    command's). Over several backends, each is answered for on its own (the module docstring)."""
    cands = list(candidates)
    backends = list(dict.fromkeys(c.backend for c in cands))
    if len(backends) > 1:
        for backend in backends:
            short = shortfall(recipe, [c for c in cands if c.backend == backend], host_limit, device_limit,
                              host_name, device_name, f"{what} of backend {backend}", disk_limit, disk_name, naming)
            if short:
                return (f"search.backend {backend}: no {backend} config fits: {short} (or drop {backend} from "
                        "search.backend)")
        return None
    limits = [Limit(r, n, name) for r, n, name in (("device", device_limit, device_name),
                                                   ("host", host_limit, host_name), ("disk", disk_limit, disk_name))
              if n is not None]
    found = [overs(recipe, c, limits) for c in smallest(cands)]
    if any(not f.over for f in found):
        return None
    closest = nearest(found)
    first = closest[0]
    text = "; and ".join(_clause(recipe, first, limit, need, f"{what} ({first.config}) is predicted to need"
                                 if i == 0 else "it needs") for i, (limit, need) in enumerate(first.over))
    for other in closest[1:]:
        text += (f"; under {_differs(first.config, other.config)} it would need "
                 + " and ".join(f"{format_bytes(need)} {WHERE[limit.resource]}, over {limit.said(first=False)}"
                                for limit, need in other.over))
    if len(closest) == 1 and [limit.resource for limit, _ in first.over] == ["device"] and \
            not any(_within(recipe, twins, limits, ["device"]) for _, _, twins in to_disk(recipe, cands, naming)):
        return text + "; raise it to at least that"     # (the weights on disk prefetch no unit on the device)
    return text + ". What would fit: " + _would_fit(recipe, cands, limits, closest, naming)


def overs(recipe: Setup, c: Candidate, limits: list[Limit]) -> Over:
    """c's prior and the limits it is over (the disk's only when it writes files: its optimizer or weights on disk,
    nvme)."""
    prior = predict(recipe, c)
    over = tuple((limit, need) for limit in limits
                 if (limit.resource != "disk" or recipe.on_disk(c) or recipe.weights_on_disk(c) or prior.disk)
                 and (need := getattr(prior, limit.resource)) > limit.size)
    return Over(c, prior, over)


def nearest(found: list[Over]) -> list[Over]:
    """The closest config first, then those that need less of some limit than every config before them (at most
    ALTERNATIVES): raising the limits any one of them names is enough."""
    ranked = sorted(found, key=lambda f: (f.excess(), f.config))
    kept: list[Over] = []
    for f in ranked:
        if not any(k.needs_no_more_than(f) for k in kept):
            kept.append(f)
    return kept[:1 + ALTERNATIVES]


def _clause(recipe: Setup, f: Over, limit: Limit, need: int, subject: str) -> str:
    """'hardware.host_memory_limit 20.0 GiB is below the 43.0 GiB (N bytes) <subject> in host memory: terms'."""
    terms = {"device": f.prior.device_terms, "host": f.prior.host_terms, "disk": f.prior.disk_terms}[limit.resource]
    ranks = " (all ranks together)" if limit.resource == "host" and recipe.world_size > 1 else ""
    return (f"{limit.said()} is below the {format_bytes(need)} ({need} bytes) {subject} {WHERE[limit.resource]}"
            f"{ranks}: {listing(terms, need)}")


def _differs(c: Candidate, other: Candidate) -> str:
    """The knobs `other` sets otherwise than `c`, as a spec names them: 'optimizer_offload host'."""
    mine = {**c.knobs(), "optimizer_offload": c.optimizer_offload, "param_offload": c.param_offload}
    theirs = {**other.knobs(), "optimizer_offload": other.optimizer_offload, "param_offload": other.param_offload}
    return " and ".join(f"{k} {v}" for k, v in theirs.items() if mine.get(k) != v)


def listing(terms: list[tuple[str, int]], total: int) -> str:
    """'the weights in bfloat16 12.6, a float32 master copy 25.1, ... GiB': every term in the total's unit."""
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if total >= s),
                       ("B", 1))
    shown = [f"{what} {n / scale:.1f}" for what, n in terms if round(n / scale, 1)]
    return ", ".join(shown) + f" {unit}"


def _would_fit(recipe: Setup, cands: list[Candidate], limits: list[Limit], closest: list[Over],
               naming: Naming = SPEC) -> str:
    """The recipe changes, alone or together, under which some least config is predicted within every limit;
    then the limits each closest config takes, all of them together."""
    named = [limit.resource for limit, _ in closest[0].over]
    fits, disk_only = [], []
    for what, why, twins in to_disk(recipe, cands, naming):
        if (f := _within(recipe, twins, limits, named)) is not None:
            fits.append(f"{what} ({why}: {format_bytes(f.prior.host)} in host memory, {format_bytes(f.prior.disk)} on "
                        "disk)")
        elif set(named) - {"disk"} and (d := _disk_only(recipe, twins, limits)) is not None:
            # within the limits the closest config is over, were there disk enough: say what disk it takes
            disk_only.append(f"{what} ({why}: {format_bytes(d.prior.host)} in host memory) with "
                             + " and ".join(limit.raised(need) for limit, need in d.over))
    fits += [f"{what}: {_needs(f, closest[0].config, named)}" for what, changed in _changes(recipe, naming)
             if (f := _within(changed, cands, limits, named)) is not None]
    takes = [" and ".join(limit.raised(need) for limit, need in f.over)
             + (f" (under {_differs(closest[0].config, f.config)})" if i else "") for i, f in enumerate(closest)]
    takes = disk_only + takes       # only more disk: before raising host memory (or the device's) with it
    text = ("; or ".join(fits + takes) if fits else
            "no change of dtype, precision or optimizer; " + "; or ".join(takes) + ", or a smaller model")
    return text + _without_process(recipe, closest)


def to_disk(recipe: Setup, cands: list[Candidate], naming: Naming = SPEC) -> list[tuple[str, str, list[Candidate]]]:
    """The places on disk the spec does not try, each as (the change a spec makes, what it moves, the configs it
    adds): the optimizer's master and state in files (training), then the weights in files too (in training
    beside the optimizer on disk), whose host memory holds a window of the weights and gradients."""
    if recipe.schedule == "resident" or not all(c.backend == "speedloader" for c in cands):
        return []
    train = recipe.mode == "train"
    out = []
    optimizer_there = any(recipe.on_disk(c) for c in cands)
    if train and not optimizer_there:
        out.append((naming.optimizer_disk, "the master and optimizer state in files",
                    [dataclasses.replace(c, optimizer_offload="disk") for c in cands]))
    if not any(recipe.weights_on_disk(c) for c in cands):
        with_optimizer = train and not optimizer_there
        what = naming.param_disk + (f" with {naming.optimizer_disk}" if with_optimizer else "")
        moved = ("the weights, the master and the optimizer state in files" if with_optimizer else
                 "the weights in files too" if train else "the weights in files")
        twins = [dataclasses.replace(c, param_offload="disk", optimizer_offload="disk" if train else
                                     c.optimizer_offload) for c in cands]
        out.append((what, moved + ", a window of the weights" + (" and gradients" if train else "")
                    + " in host memory", twins))
    return out


def _disk_only(recipe: Setup, cands: list[Candidate], limits: list[Limit]) -> Over | None:
    """The least config over the disk limit alone (within every other), the one needing the least disk; or None."""
    only = [f for f in (overs(recipe, c, limits) for c in smallest(cands))
            if f.over and {limit.resource for limit, _ in f.over} == {"disk"}]
    return min(only, key=lambda f: (f.prior.disk, f.config), default=None)


def _without_process(recipe: Setup, closest: list[Over]) -> str:
    """The spec's own check predicts without the trial process (it is the machine's that runs the trials): its host
    figures take that process's memory on top, or the spec is refused again where trials run."""
    if recipe.baseline or not any(limit.resource == "host" for f in closest for limit, _ in f.over):
        return ""
    return " (the host figures leave out the trial process's own memory; `sltune plan SPEC.yaml` adds it)"


def _changes(recipe: Setup, naming: Naming = SPEC) -> list[tuple[str, Setup]]:
    """Each change of precision, optimizer or dtype that needs less memory; and one version of the disk tier's files
    (half the disk) where the command takes it."""
    from sltune.tuning.cost.shape import shape_of

    changes: list[tuple[str, Setup]] = []
    if naming.disk_versions and recipe.disk_versions == 2:
        changes.append((f"{naming.disk_versions} (one version of the disk tier's files: about half the disk)",
                        dataclasses.replace(recipe, disk_versions=1)))
    sgd = OptimizerConfig(name="sgd")
    train = recipe.mode == "train"
    if train and recipe.master:
        changes.append((f"{naming.no_master} (one {recipe.shape.dtype} copy, no float32 master)",
                        dataclasses.replace(recipe, mixed_precision=False)))
    if train and recipe.optimizer.state_bytes_per_param():
        changes.append((f"{naming.sgd} (no optimizer state)",
                        dataclasses.replace(recipe, optimizer=sgd)))
    if train and recipe.master and recipe.optimizer.state_bytes_per_param():
        changes.append((f"{naming.no_master} and {naming.sgd}",
                        dataclasses.replace(recipe, mixed_precision=False, optimizer=sgd)))
    if recipe.shape.dtype == "float32":
        shape = shape_of(recipe.source, "bfloat16")
        half = dataclasses.replace(recipe, shape=at_depth(shape, recipe.shape.layers)
                                   if recipe.shape.layers < shape.layers else shape)
        changes.append((naming.bf16, half))
        if train:
            changes.append((f"{naming.bf16} with {naming.no_master}",
                            dataclasses.replace(half, mixed_precision=False)))
    return changes


def _needs(f: Over, closest: Candidate, named: list[str]) -> str:
    """'30.1 GiB in host memory, 50.2 GiB on disk': what a config within every limit needs (the device's when the
    refusal named it; the disk's when it has files), and where its optimizer lives when that is not where the closest
    config's does."""
    shown = [r for r in RESOURCES if r == "host" or (r == "disk" and f.prior.disk)
             or (r == "device" and r in named)]
    place = "".join(f" with {knob} {mine}" for knob, mine, theirs in (
        ("optimizer_offload", f.config.optimizer_offload, closest.optimizer_offload),
        ("param_offload", f.config.param_offload, closest.param_offload)) if mine != theirs)
    return ", ".join(f"{format_bytes(getattr(f.prior, r))} {WHERE[r]}" for r in shown) + place


def _within(recipe: Setup, cands: list[Candidate], limits: list[Limit], named: list[str]) -> Over | None:
    """The least config predicted within every limit that needs the least of the `named` resources, or None."""
    ok = [f for f in (overs(recipe, c, limits) for c in smallest(cands)) if not f.over]
    return min(ok, key=lambda f: (tuple(getattr(f.prior, r) for r in named), f.config), default=None)


def disk_room(asked: int | None, root: Path, asked_name: str = "hardware.disk_limit") -> tuple[int | None, str]:
    """The disk limit disk configs are held to, and its name for a refusal: the asked one (hardware.disk_limit, or
    `asked_name`), or the free space where trials offload to (`root`) when that is less or nothing was asked (a
    FreeSpace name, which says it overrides the asked one)."""
    free = free_bytes(root)
    if asked is not None and (free is None or asked <= free):
        return asked, asked_name
    return free, FreeSpace(root, asked, free, asked_name)


def free_bytes(folder: Path) -> int | None:
    """Free bytes on the filesystem `folder` is (or will be) on: its nearest existing ancestor's."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
