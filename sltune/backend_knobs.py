"""Each backend's name and knobs, declared once as fields, and the one-line refusals of a knob that does not fit
(light: no torch).

The config, the trial spec and a trial's result declare the backend and its knobs with BackendKnobs, and the first
two validate them with CheckedBackendKnobs: one wording everywhere. This module sits beside sltune.backends, not in
it, because sltune.config is built on it (a best.yaml names its backend and knobs) while the backends drive the
runtime, which reads sltune.config: inside sltune.backends it would tie config and backends in a circle, which the
import contract forbids. Everything imports it from here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

BackendName = Literal["speedloader", "deepspeed", "fsdp"]
ZeroStage = Literal[2, 3]
OffloadTarget = Literal["none", "cpu", "nvme"]

BACKENDS: tuple[str, ...] = ("speedloader", "deepspeed", "fsdp")


@dataclass(frozen=True)
class Knob:
    """What a knob is to the rest of the house, declared beside it as metadata of its type
    (`num_live_blocks: Annotated[int, Knob(speedloader=True)] = Field(...)`), so that what follows from it is derived
    instead of listed again: which knobs another backend refuses (speedloader_only), and what a trial's result records
    (sltune.profiling.schema.TrialConfig)."""

    speedloader: bool = False
    """SpeedLoader's engine's alone: another backend refuses a value other than its default, and its trials record
    None for it"""
    mode: Literal["train", "generate"] | None = None
    """what only training or only generation reads: a trial of the other mode records None for it"""
    recorded: Literal["always", "changed", "never"] = "always"
    """in a trial's result: always, only away from its default (as results recorded before the knob read), never
    (how the trial ran, not a config of the search: the device, the dtype, a folder)"""
    searched: bool = False
    """a job's search sweeps it (sltune.tuning.spec.Search), so that configs of one job differ in it: comparing jobs
    (sltune.tuning.report.compare) keys a config on the knobs searched, then the backend's"""


def marked(model: type[BaseModel], kind: type) -> dict[str, Any]:
    """A model's fields whose declaration carries a `kind` marker (Knob, BackendKnob), each with its marker."""
    return {name: m for name, field in model.model_fields.items() for m in field.metadata if isinstance(m, kind)}


@functools.cache
def knobs_of(model: type[BaseModel]) -> dict[str, Knob]:
    """A model's fields that are knobs, each with what its declaration says of it (once per model: every config and
    trial spec validated asks)."""
    return marked(model, Knob)


@functools.cache
def speedloader_only(model: type[BaseModel]) -> dict[str, Any]:
    """What only SpeedLoader's engine has among a model's fields, with the default another backend runs."""
    return {name: model.model_fields[name].default for name, knob in knobs_of(model).items() if knob.speedloader}


@dataclass(frozen=True)
class BackendKnob:
    """A wrapped backend's knob, declared once as a field of BackendKnobs (backend_knob): whose it is, what it runs
    when left out, what a search sweeps when its section leaves it out, and its doc. The backends' knob lists and
    defaults, and the spec's search sections (sltune.tuning.spec), are derived from it."""

    backend: str
    default: Any
    search: tuple[Any, ...]
    doc: str


def backend_knob(backend: str, default: Any, *, search: tuple[Any, ...], doc: str) -> Any:
    """A field of BackendKnobs: None where another backend's, its doc saying whose it is and its default."""
    shown = str(default).lower() if isinstance(default, bool) else default
    info = Field(None, description=f"{backend}: {doc}; default {shown}")
    info.metadata.append(BackendKnob(backend, default, search, doc))
    return info


class BackendKnobs(BaseModel):
    """What trains (SpeedLoader's engine or a wrapped backend) and every backend's knobs, None where another
    backend's: the fields a config, a trial spec and a trial's result share."""

    backend: BackendName = Field(
        "speedloader", description="what trains: SpeedLoader's engine, DeepSpeed ZeRO (deepspeed.initialize; `bash "
        "scripts/install.sh backends` installs it) or PyTorch FSDP2 (fully_shard per decoder layer); the b*N rows of "
        "a step as N micro-batches of b. num_live_blocks, schedule, optimizer_offload, param_offload and "
        "disk_versions are SpeedLoader's")
    zero_stage: ZeroStage | None = backend_knob(
        "deepspeed", 2, search=(2, 3), doc="ZeRO stage 2 (the optimizer state and gradients partitioned) or 3 (the "
        "parameters too)")
    offload_optimizer: OffloadTarget | None = backend_knob(
        "deepspeed", "none", search=("none", "cpu"), doc="the optimizer's state in device memory (none), host memory "
        "(cpu) or files on NVMe (nvme)")
    offload_param: OffloadTarget | None = backend_knob(
        "deepspeed", "none", search=("none", "cpu"), doc="ZeRO-3's parameter partitions on the device (none), in host "
        "memory (cpu) or on NVMe (nvme); at zero_stage 2 only none runs")
    cpu_offload: bool | None = backend_knob(
        "fsdp", False, search=(False, True), doc="CPUOffloadPolicy: the sharded parameters, gradients and optimizer "
        "state in host memory")
    reshard_after_forward: bool | None = backend_knob(
        "fsdp", True, search=(True,), doc="free each layer's gathered parameters after its forward and gather them "
        "again for its backward (true), or keep them for its backward (false: more device memory, no second gather)")


# what follows from the declarations above: each backend's knobs in order, and what each runs when left out
BACKEND_KNOB: dict[str, BackendKnob] = marked(BackendKnobs, BackendKnob)
KNOBS: dict[str, tuple[str, ...]] = {b: tuple(n for n, k in BACKEND_KNOB.items() if k.backend == b) for b in BACKENDS}
ALL_KNOBS: tuple[str, ...] = tuple(BACKEND_KNOB)
DEFAULTS: dict[str, Any] = {name: knob.default for name, knob in BACKEND_KNOB.items()}


class CheckedBackendKnobs(BackendKnobs):
    """The knobs of what is asked to run: a knob of another backend, or a SpeedLoader-only value under another
    backend, is refused naming the field and the fix; the backend's own knobs left out take their defaults, so the
    model names every knob its backend runs with."""

    @model_validator(mode="after")
    def _backend_knobs(self) -> "CheckedBackendKnobs":
        why = refusals({name: getattr(self, name) for name in type(self).model_fields}, speedloader_only(type(self)))
        if why:
            raise ValueError("; ".join(why))
        for knob in KNOBS[self.backend]:
            if getattr(self, knob) is None:
                self.__dict__[knob] = DEFAULTS[knob]     # a frozen model too: set once, while validating
        return self


def _backend_knobs(self: Any) -> dict[str, Any]:
    """Its backend's own knobs: {} for speedloader."""
    return {knob: getattr(self, knob) for knob in KNOBS[self.backend]}


# The same fields as plain ones, derived from BackendKnobs: what a search candidate (sltune.tuning.space.Candidate) and
# a backend's input (sltune.backends.base.TrainingSpec) carry, keyword-only after their own fields
BackendChoice = dataclasses.make_dataclass(
    "BackendChoice", [(name, field.annotation, dataclasses.field(default=field.default))
                      for name, field in BackendKnobs.model_fields.items()],
    frozen=True, kw_only=True,
    namespace={"__module__": __name__, "backend_knobs": _backend_knobs,
               "__doc__": "What trains and its backend's knobs, as a dataclass's fields (BackendKnobs')."})


def owner(knob: str) -> str:
    """The backend a knob belongs to."""
    return next(b for b, names in KNOBS.items() if knob in names)


def libaio_found() -> bool:
    """DeepSpeed's NVMe offload runs its async I/O op, built against libaio: its header and its library."""
    import ctypes.util
    import os

    dirs = ["/usr/include", "/usr/local/include", *filter(None, os.environ.get("CPATH", "").split(os.pathsep))]
    header = any(os.path.isfile(os.path.join(d, "libaio.h")) for d in dirs)
    return header and ctypes.util.find_library("aio") is not None


def refusals(values: dict[str, Any], only: dict[str, Any]) -> list[str]:
    """Why these trial values do not make a run of their backend, one line per field, each naming the field
    and the fix; [] when they do. `values` holds `backend`, the knobs and the fields read here; `only`, what only
    SpeedLoader has among them and the default another backend runs (speedloader_only)."""
    backend = values.get("backend", "speedloader")
    out = []
    for knob in (k for names in KNOBS.values() for k in names):
        if values.get(knob) is not None and knob not in KNOBS[backend]:
            article = "an" if owner(knob) == "fsdp" else "a"
            out.append(f"{knob}: {article} {owner(knob)} knob; add backend {owner(knob)}, or drop {knob} "
                       f"(backend {backend} has {', '.join(KNOBS[backend]) or 'none of these knobs'})")
    if backend == "speedloader":
        return out
    for field, default in only.items():
        if values.get(field, default) != default:
            out.append(f"{field}: {values[field]!r} is SpeedLoader's; backend {backend} runs "
                       f"{field} {default!r} only (drop {field}, or use backend speedloader)")
    dtype = values.get("dtype", "float32")
    if dtype != "float32" and values.get("mixed_precision") is False:
        out.append(f"mixed_precision: backend {backend} keeps float32 master weights under {dtype}; keep mixed "
                   "precision on, or use backend speedloader")
    if backend == "fsdp" and dtype == "float16":
        out.append("dtype: float16 needs loss scaling, which the fsdp backend does not run; use bfloat16 (its "
                   "MixedPrecisionPolicy) or float32")
    if backend == "deepspeed":
        out += _deepspeed(values)
    elif values.get("offload_dir"):
        out.append(f"offload_dir: backend {backend} writes no offload files; drop offload_dir")
    return out


def _deepspeed(values: dict[str, Any]) -> list[str]:
    out = []
    stage = values.get("zero_stage") or DEFAULTS["zero_stage"]
    param = values.get("offload_param") or "none"
    if param != "none" and stage != 3:
        out.append(f"offload_param: {param} offloads ZeRO-3's parameter partitions; set zero_stage 3, or "
                   "offload_param none")
    if "nvme" in (param, values.get("offload_optimizer")):
        which = "offload_param" if param == "nvme" else "offload_optimizer"
        if not values.get("offload_dir"):
            out.append(f"{which}: nvme swaps to files under offload_dir; give offload_dir (a directory on a "
                       "local NVMe disk)")
        elif not libaio_found():
            out.append(f"{which}: nvme needs libaio for DeepSpeed's async I/O (apt-get install libaio-dev, then "
                       "reinstall deepspeed), or use cpu")
    if values.get("offload_dir") and "nvme" not in (param, values.get("offload_optimizer")):
        out.append("offload_dir: only nvme offload writes there; set offload_optimizer or offload_param nvme, or "
                   "drop offload_dir")
    return out

