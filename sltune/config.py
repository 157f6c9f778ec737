"""The SpeedLoader knobs, validated once, and the YAML file a tuning job exports."""

from __future__ import annotations

import re

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sltune.backend_knobs import ALL_KNOBS, KNOBS, CheckedBackendKnobs, Knob
from sltune.field_errors import one_line, unknown_among
from sltune.sizes import Bytes
from sltune.yamlfile import read_yaml

# torch's device types (c10's DeviceType names), an index after a colon
DEVICE = re.compile(r"(cpu|cuda|mps|xpu|meta|hip|ipu|xla|hpu|mtia|vulkan|mkldnn|opengl|opencl|ideep|ve|fpga|lazy|"
                    r"privateuseone)(:\d+)?")

Schedule = Literal["speedloader", "canonical", "resident"]
DType = Literal["float32", "bfloat16", "float16"]
Activations = Literal["recompute", "offload"]
KVCache = Literal["host", "device"]
OptimizerOffload = Literal["host", "disk"]
ParamOffload = Literal["host", "disk"]

PARAM_OFFLOAD_TRAIN = ("param_offload disk: training steps each unit's weights file with its optimizer block; add "
                       "optimizer_offload disk")

# Sections a best-config YAML carries besides the knobs: reports, read by `sltune plan`, ignored here.
REPORT_SECTIONS = ("effective_batch_size", "workload", "measured", "predicted", "resource_models",
                   "limits", "binding_limit", "search_space", "provenance", "trials", "confidence", "optimizer")
# ...of which `optimizer` is read by `sltune train` (sltune.training.OptimizerConfig): the optimizer the job
# was tuned with and will train with
# The backend and every backend's knobs: a speedloader config's YAML leaves them out
BACKEND_FIELDS = ("backend", *ALL_KNOBS)


def param_offload_refusal(param_offload: str, optimizer_offload: str, train: bool) -> str | None:
    """Where the weights may live in training, the one rule and its one wording (the config, the engine, a trial,
    the search space and the CLI ask here): a step writes each unit's weights file with its optimizer block, so
    param_offload disk trains only beside optimizer_offload disk. Generation reads the files alone."""
    return PARAM_OFFLOAD_TRAIN if train and param_offload == "disk" and optimizer_offload != "disk" else None


class RuntimeKnobs(BaseModel):
    """Every knob of the runtime, each declared here once with its doc under it and what it is to the rest (its Knob:
    SpeedLoader's alone, read in one mode, recorded by a trial): the best-config YAML (SpeedLoaderConfig), a trial's
    spec and result (sltune.profiling.schema), the CLI flags of `profile` and `train` (sltune.cli.flags), what
    another backend refuses (sltune.backend_knobs.speedloader_only) and the reference pages
    (docs/hooks/reference.py) are derived from these fields, and the rules between them are checked here, once, in
    one wording."""

    sub_batch_size: Annotated[int, Knob(searched=True)] = Field(1, ge=1, description="rows per sub-batch (b)")
    num_sub_batches: Annotated[int, Knob(searched=True)] = Field(
        1, ge=1, description="sub-batches per optimizer step (N); effective batch b*N")
    num_live_blocks: Annotated[int, Knob(speedloader=True, searched=True)] = Field(
        1, ge=1, description="decoder layers loaded on the device at once (k)")
    schedule: Annotated[Schedule, Knob(speedloader=True)] = Field(
        "speedloader", description="'speedloader' runs every sub-batch through a group of k layers before the next "
        "group; 'canonical' runs each sub-batch through the whole model (the weights loaded N times); 'resident' "
        "keeps the whole model on the device (no weight traffic: the baseline that fits only small models)")
    activations: Annotated[Activations, Knob(searched=True)] = Field(
        "recompute", description="how a group's backward gets its forward's intermediates: 'recompute' runs the "
        "forward again from the stored group input (device memory: one group, one sub-batch); 'offload' keeps "
        "autograd's saved tensors of every sub-batch in host memory (no recompute; more host memory and traffic). "
        "The resident schedule recomputes nothing either way")
    device: Annotated[str, Knob(recorded="never")] = Field(
        "cpu", description="the torch device that computes: cpu, cuda, cuda:1, ...")
    dtype: Annotated[DType, Knob(recorded="never")] = Field(
        "float32", description="what the device computes in: float32, bfloat16 or float16")
    mixed_precision: Annotated[bool, Knob(recorded="never")] = Field(
        True, description="with dtype bfloat16 or float16: float32 master weights, gradients and optimizer state on "
        "the host, the device computing in dtype (float16 adds dynamic loss scaling). False keeps one copy in "
        "dtype, stepped in dtype. float32 is unaffected either way; generation never needs the master")
    device_memory_limit: Annotated[Bytes | None, Knob(recorded="never")] = Field(
        None, description="the most device memory a step may allocate, in bytes or as a string such as '2GiB'; none "
        "sets no limit")
    world_size: Annotated[int | None, Knob()] = Field(
        None, ge=1, description="ranks the config was tuned for; None: any")
    kv_cache: Annotated[KVCache, Knob(mode="generate", searched=True)] = Field(
        "host", description="generation: KV caches in host memory (attention over the past where it lives) or on "
        "the device (no KV traffic, device memory instead); the resident schedule keeps them on the device")
    weights_on_device: Annotated[float, Knob(mode="generate", searched=True)] = Field(
        0.0, ge=0.0, le=1.0, description="generation: the share of the parameter bytes kept on the device for a "
        "whole generate call once loaded, in whole units (tied weights, embedding, head, then groups in order, "
        "each that still fits the share); the rest is copied in at every step. Device memory instead of "
        "parameter traffic; training ignores it, and the resident schedule keeps every weight there")
    optimizer_offload: Annotated[OptimizerOffload, Knob(speedloader=True, mode="train", searched=True)] = Field(
        "host", description="training: where the float32 master weights (mixed precision) and the optimizer state "
        "live: 'host' memory, or files under offload_dir ('disk'), a bounded window of units in host memory, the "
        "optimizer stepping unit by unit as gradients arrive (sltune.runtime.disk.state)")
    param_offload: Annotated[ParamOffload, Knob(speedloader=True, recorded="changed", searched=True)] = Field(
        "host", description="where the dtype copy of the weights the device loads lives between loads: 'host' "
        "memory, or a file per unit under offload_dir ('disk'), read ahead with O_DIRECT into a bounded window of "
        "host buffers just before the device needs it (sltune.runtime.disk.weightfiles). Training needs "
        "optimizer_offload 'disk' with it. Over several ranks each rank's shards go to files of its own")
    offload_dir: Annotated[str | None, Knob(recorded="never")] = Field(
        None, description="optimizer_offload or param_offload 'disk': the directory of the files (a local disk with "
        "room for the master and optimizer state twice, and the weights twice: a step writes new files before it "
        "drops the old ones; once, and a few blocks, under disk_versions 1)")
    disk_versions: Annotated[Literal[1, 2], Knob(speedloader=True, recorded="changed")] = Field(
        2, description="optimizer_offload 'disk' (and param_offload 'disk', its weights files): versions of the files "
        "a step keeps. 2 writes the new version beside the committed one and drops the old files once the step "
        "commits: a step that fails in-process rolls back, and the disk holds two versions (24 bytes a parameter "
        "of master and AdamW state). 1 drops each old file as soon as its new one is in place: the disk holds one "
        "version and the window's blocks in flight (about half), but a step that fails part-way cannot roll back: "
        "the run stops and resumes from its last checkpoint (--resume), which a kill needs anyway")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        """torch.device's grammar, a device type then :index, checked without torch: a tune or worker process writes
        and reads best.yaml without importing it."""
        if not DEVICE.fullmatch(value):
            raise ValueError(f"device {value!r} is not a torch device name; use 'cpu', 'cuda' or 'cuda:1'")
        return value

    @field_validator("weights_on_device", mode="before")
    @classmethod
    def _share(cls, value: Any) -> Any:
        """A share, worded as one (NaN too); a value that is no number is pydantic's to refuse."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value <= 1:
            raise ValueError(f"give a share from 0 (no weights kept on the device) to 1 (all of them), not {value:g}")
        return value

    @model_validator(mode="after")
    def _disk(self) -> "RuntimeKnobs":
        """What the files on disk need: a folder, and a schedule that keeps weights and optimizer on the host."""
        why = []
        if self.optimizer_offload == "disk" and not self.offload_dir:
            why.append("offload_dir: optimizer_offload disk keeps the optimizer's files there; give a directory on a "
                       "local disk (--offload-dir DIR)")
        elif self.param_offload == "disk" and not self.offload_dir:
            why.append("offload_dir: param_offload disk keeps the weights' files there; give a directory on a local "
                       "disk (--offload-dir DIR)")
        if self.optimizer_offload == "disk" and self.schedule == "resident":
            why.append("optimizer_offload disk: the resident schedule steps its optimizer on the device; use "
                       "optimizer_offload host, or schedule speedloader or canonical")
        if self.param_offload == "disk" and self.schedule == "resident":
            why.append("param_offload disk: the resident schedule keeps every weight on the device; use param_offload "
                       "host, or schedule speedloader or canonical")
        if why:
            raise ValueError("; ".join(why))
        return self


class SpeedLoaderConfig(RuntimeKnobs, CheckedBackendKnobs):
    """How the runtime schedules one model: b, N and k, the schedule, and where it runs; or, under another backend
    (its knobs in CheckedBackendKnobs), what that backend trains with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_tracking: Annotated[Literal["first", "always", "never"], Knob(recorded="never")] = Field(
        "first", description="CPU only: measure device allocations on the first step of each batch shape, "
        "on every step, or never (then device_memory_limit cannot be enforced)")

    @property
    def effective_batch_size(self) -> int:
        return self.sub_batch_size * self.num_sub_batches

    @property
    def has_master(self) -> bool:
        """Whether training keeps float32 master weights beside the dtype copy."""
        return self.mixed_precision and self.dtype != "float32"

    # -- YAML ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "SpeedLoaderConfig":
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of config fields, got {type(data).__name__}")
        knobs = {k: v for k, v in data.items() if k not in REPORT_SECTIONS}
        try:
            cfg = cls(**knobs)
        except ValidationError as err:
            raise ValueError(f"{source}: " + one_line(err, unknown=unknown_among(cls.model_fields))) from None
        batch = data.get("effective_batch_size")
        if batch is not None and batch != cfg.effective_batch_size:
            raise ValueError(
                f"{source}: effective_batch_size {batch} != sub_batch_size*num_sub_batches "
                f"({cfg.sub_batch_size}*{cfg.num_sub_batches}={cfg.effective_batch_size}); fix one of them"
            )
        return cfg

    @classmethod
    def from_yaml(cls, path: str | Path) -> "SpeedLoaderConfig":
        """Reads the best-config file a tuning job exports (or any YAML with the knobs at the top)."""
        return cls.from_dict(read_yaml(path), source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """The fields, the backend and its knobs first under another backend; a speedloader config without them (its
        YAML byte for byte as before there were backends)."""
        out = self.model_dump()
        if out["disk_versions"] == 2:       # the default: YAML as before the field
            del out["disk_versions"]
        knobs = {name: out.pop(name) for name in BACKEND_FIELDS}
        if self.backend != "speedloader":
            out = {"backend": self.backend, **{k: knobs[k] for k in KNOBS[self.backend]}, **out}
        out["effective_batch_size"] = self.effective_batch_size
        return out

    def to_yaml(self, path: str | Path | None = None, **sections: Any) -> str:
        """The knobs first, then any report sections (measured, predicted, provenance...)."""
        data = self.to_dict()
        unknown = set(sections) - set(REPORT_SECTIONS)
        if unknown:
            raise ValueError(f"to_yaml: unknown sections {sorted(unknown)}; allowed: {list(REPORT_SECTIONS)}")
        data.update({k: v for k, v in sections.items() if v is not None})
        text = "# sltune SpeedLoader config; read it with SpeedLoaderConfig.from_yaml\n"
        if self.backend != "speedloader":
            text = (f"# sltune config for backend {self.backend}: `sltune train --config FILE` trains with it; read it "
                    "with SpeedLoaderConfig.from_yaml\n")
        text += yaml.safe_dump(data, sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    def replace(self, **changes: Any) -> "SpeedLoaderConfig":
        return SpeedLoaderConfig(**{**self.model_dump(), **changes})
