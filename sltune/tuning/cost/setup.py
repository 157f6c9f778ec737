"""What every config of a job shares, as the memory priors read it (sltune.tuning.cost.prior for SpeedLoader's
engine, sltune.tuning.cost.wrapped for DeepSpeed and FSDP): the model, how it is stepped, where it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sltune.training.optimizer import OptimizerConfig
from sltune.tuning.cost.shape import ModelShape

if TYPE_CHECKING:
    from sltune.profiling.schema import TrialSpec
    from sltune.tuning.space import Candidate
    from sltune.tuning.spec import TuningSpec


@dataclass(frozen=True)
class Setup:
    """What every config of a job shares: the model, how it is stepped, where it runs."""

    source: Any                     # a preset's name, an inline config.json or a folder: what the footprint traces
    shape: ModelShape
    mode: str = "train"
    schedule: str = "speedloader"
    mixed_precision: bool = True
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    world_size: int = 1
    device: str = "cpu"
    seq_len: int = 128
    prompt_len: int = 32
    new_tokens: int = 16
    baseline: int = 0               # what a trial process holds before its model (sltune.tuning.cost.baseline)
    optimizer_offload: str = "host"  # disk: the float32 master and the optimizer state live in files (a
                                     # candidate's optimizer_offload says so too: either makes it disk)
    param_offload: str = "host"      # disk: the dtype weights live in files (a candidate's param_offload too)
    clips: bool = False              # training clips the global gradient norm (trials never do; `sltune train` may)
    disk_versions: int = 2           # versions of the disk tier's files a step keeps (SpeedLoaderConfig.disk_versions)

    @classmethod
    def of_spec(cls, spec: "TuningSpec", shape: ModelShape, baseline: int = 0) -> "Setup":
        w, hw = spec.workload, spec.hardware
        return cls(spec.model.source, shape, w.mode, spec.search.schedule, spec.model.mixed_precision, spec.optimizer,
                   hw.world_size, hw.device, w.seq_len, w.prompt_len, w.new_tokens, baseline)

    @classmethod
    def of_trial(cls, trial: "TrialSpec", shape: ModelShape, baseline: int = 0) -> "Setup":
        return cls(trial.model, shape, trial.mode, trial.schedule, trial.mixed_precision, trial.optimizer,
                   trial.world_size, trial.device, trial.seq_len, trial.prompt_len, trial.new_tokens, baseline,
                   getattr(trial, "optimizer_offload", "host"), getattr(trial, "param_offload", "host"),
                   disk_versions=getattr(trial, "disk_versions", None) or 2)

    @property
    def master(self) -> bool:
        """Training under a float32 master: mixed precision in bfloat16 or float16."""
        return self.mode == "train" and self.mixed_precision and self.shape.dtype != "float32"

    @property
    def on_cpu(self) -> bool:
        return self.device.split(":")[0] == "cpu"

    def on_disk(self, c: Candidate) -> bool:
        """Whether c's optimizer lives in files: training, not resident (the config refuses it there)."""
        return self.mode == "train" and self.schedule != "resident" and \
            "disk" in (self.optimizer_offload, c.optimizer_offload)

    def weights_on_disk(self, c: Candidate) -> bool:
        """Whether c's dtype weights live in files (param_offload disk): not resident (the config refuses it)."""
        return self.schedule != "resident" and "disk" in (self.param_offload, c.param_offload)

    @property
    def deferred(self) -> bool:
        """Training on disk whose step waits for every gradient before any unit steps (sltune.runtime.engine's
        _early): float16's loss scaling (its overflow check), clipping on the global norm, or no float32 master (a
        failure part-way could not be undone). Under param_offload disk its gradients wait in files."""
        return self.mode == "train" and (self.clips or not self.master or self.shape.dtype == "float16")

    @property
    def grad_bytes(self) -> int:
        """Bytes per value of a gradient sum: float32 under a master, else dtype."""
        return 4 if self.master else self.shape.itemsize

    @property
    def disk_value_bytes(self) -> int:
        """Bytes per stepped value in a block's file: the float32 master (under one) and the optimizer's state
        (float32 under a master, else dtype)."""
        step = 4 if self.master else self.shape.itemsize
        return (4 if self.master else 0) + self.optimizer.state_bytes_per_param(step)
