"""What a trial is asked to run (TrialSpec) and what it reports (TrialResult, the JSON in the design)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_serializer, model_validator

from sltune.backend_knobs import (ALL_KNOBS, KNOBS, BackendKnobs, CheckedBackendKnobs, Knob, knobs_of,
                                   speedloader_only)
from sltune.config import RuntimeKnobs, param_offload_refusal
from sltune.runtime.counters import IOCounters
from sltune.sizes import Bytes
from sltune.training.optimizer import OptimizerConfig

Status = Literal["ok", "oom", "failed", "timeout", "diverged"]


class TrialSpec(RuntimeKnobs, CheckedBackendKnobs):
    """One configuration of the runtime (or of another backend), run for a few steps in its own process: the
    runtime's knobs as RuntimeKnobs declares them, and how the trial runs and measures."""

    model_config = ConfigDict(extra="forbid")

    model: str | dict[str, Any] = Field("llama-tiny", description="preset, config.json path, inline config, or a "
                                        "Hugging Face model folder (whose weights the trial loads, if it has any)")
    world_size: Annotated[int, Knob()] = Field(1, ge=1, description="ranks the trial launches (gloo on the CPU)")
    nodes: int = Field(1, ge=1, description="machines the ranks are spread over, world_size / nodes on each, in rank "
                       "order (a Ray cluster's nodes: sltune.executors)")
    mode: Annotated[Literal["train", "generate"], Knob(speedloader=True, recorded="never")] = Field(
        "train", description="time training steps, or generate calls")
    seq_len: int = Field(128, ge=2, description="train: tokens per row")
    prompt_len: int = Field(32, ge=1, description="generate: prompt tokens per row")
    new_tokens: int = Field(16, ge=1, description="generate: tokens generated per row")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="train: what the engine steps "
                                       "the host parameters with, as the training job will")
    models_dir: str | None = Field(None, description="a server's job: the model folder's files are read only inside "
                                   "this folder, each checked as it is opened (sltune.models.confined)")
    host_memory_limit: Bytes | None = Field(None, description="the trial is stopped as 'oom' above this RSS")
    steps: int = Field(2, ge=1, description="timed steps at least")
    min_time_s: float = Field(2.0, ge=0, description="time steps until they add up to this many seconds")
    max_steps: int = Field(100, ge=1, description="timed steps at most while calibrating to min_time_s")
    remeasure: int = Field(1, ge=0, description="more rounds allowed when a round is unstable")
    cpu_threads: int | None = Field(None, ge=1, description="torch intra-op threads; None: all cores")
    warmup_steps: int = Field(1, ge=1, description="untimed steps first; the first measures device memory (a "
                              "wrapped backend's first two: its optimizer makes its state at the first)")
    profile: bool = True
    trace_path: str | None = None
    timeout_s: float = Field(600.0, gt=0)
    seed: int = 0
    num_layers: int | None = Field(None, ge=1, description="run this many decoder layers instead of the model's "
                                   "own, every width unchanged (the tuner's reduced-depth probes; seeded random "
                                   "weights, also for a model folder); None: the whole model")

    @property
    def per_node(self) -> int:
        """Ranks on each node."""
        return self.world_size // self.nodes

    @model_validator(mode="after")
    def _ranks_per_node(self) -> "TrialSpec":
        if self.world_size % self.nodes:
            raise ValueError(f"world_size {self.world_size} is not a whole number of ranks on each of {self.nodes} "
                             "nodes; make it a multiple of nodes")
        return self

    @model_validator(mode="after")
    def _param_offload(self) -> "TrialSpec":
        why = param_offload_refusal(self.param_offload, self.optimizer_offload, self.mode == "train")
        if why and self.backend == "speedloader":
            raise ValueError(why)
        return self

    @property
    def rows(self) -> int:
        return self.sub_batch_size * self.num_sub_batches

    def knobs(self) -> dict[str, Any]:
        """The config it runs, as its result records it (TrialConfig): each knob as its Knob says, None where its
        backend or mode does not read it, the tokens a row holds, the depth, and the backend's own knobs."""
        out: dict[str, Any] = {}
        for name, knob in RECORDED.items():
            value = getattr(self, name)
            if (knob.speedloader and self.backend != "speedloader") or (knob.mode and knob.mode != self.mode):
                value = None
            if knob.recorded == "always" or value not in (None, type(self).model_fields[name].default):
                out[name] = value
        return {**out, "seq_len": self.seq_len if self.mode == "train" else self.prompt_len + self.new_tokens,
                "num_layers": self.num_layers, "backend": self.backend,
                **{knob: getattr(self, knob) for knob in KNOBS[self.backend]}}


# What a trial's result records of its spec's knobs, and what only SpeedLoader has among them (derived from their Knobs)
RECORDED = {name: knob for name, knob in knobs_of(TrialSpec).items() if knob.recorded != "never"}
SPEEDLOADER_ONLY = speedloader_only(TrialSpec)


class _RecordedConfig(BackendKnobs):
    """The config a trial ran; its backend's knobs only (backend speedloader in results older than backends)."""

    @model_serializer(mode="wrap")
    def _its_own_knobs(self, handler) -> dict[str, Any]:
        """The backend's own knobs only: another backend's (None) are left out, so a SpeedLoader result reads as
        it did before there were backends, plus its name."""
        out = handler(self)
        for knob in (*ALL_KNOBS, *(name for name, knob in RECORDED.items() if knob.recorded == "changed")):
            if out.get(knob, 0) is None:
                del out[knob]
        return out


def _recorded(name: str) -> tuple[Any, Any]:
    """A knob as a result records it: as TrialSpec declares it, with its default where every trial reads it (a result
    older than the knob), else None where its backend or mode does not read it."""
    field, knob = TrialSpec.model_fields[name], RECORDED[name]
    if knob.speedloader or knob.mode or knob.recorded == "changed":
        when = [*(["under another backend"] if knob.speedloader else []),
                *([f"in a trial that does not {knob.mode}"] if knob.mode else []),
                *(["at its default (left out)"] if knob.recorded == "changed" else [])]
        return field.annotation | None, Field(None, description=f"{field.description} (None {' or '.join(when)})")
    return field.annotation, Field(field.default, description=field.description)


TrialConfig = create_model(
    "TrialConfig", __base__=_RecordedConfig, __module__=__name__, __doc__=_RecordedConfig.__doc__,
    **{name: _recorded(name) for name in RECORDED},
    seq_len=(int, Field(description="tokens per row: train, seq_len; generate, the prompt and the new tokens")),
    num_layers=(int | None, Field(None, description="the decoder layers the trial ran (fewer than the model's in a "
                                  "reduced-depth probe); None in results older than the field")))


class Parity(BaseModel):
    """The trial's step-1 loss against plain PyTorch's on the same initial weights and batch
    (sltune.profiling.parity)."""

    loss: float = Field(description="the backend's loss on its first step, before any update")
    reference_loss: float = Field(description="the model's own forward with labels on that batch, same dtype")
    rel_diff: float = Field(description="|loss - reference_loss| / |reference_loss|")
    tolerance: float = Field(description="the largest rel_diff a correct run of this dtype shows")
    ok: bool
    cause: str | None = Field(None, description="when reference_loss is not finite, why: the model's first tensor "
                              "holding NaN or infinity, or its activations overflowing the dtype (no config's fault)")


class BreakdownFractions(BaseModel):
    compute: float = 0.0
    memcpy: float = 0.0
    cpu: float = 0.0
    all_gather: float = 0.0
    reduce_scatter: float = 0.0
    disk: float = 0.0
    other: float = 0.0


class Interference(BaseModel):
    """What else used the machine while the steps were timed (observed, not guessed)."""

    wall_s: float
    process_cpu_s: float = Field(description="CPU time of the trial process, all threads")
    threads: int = Field(description="torch intra-op threads the trial used")
    cores: int
    process_cpu_share: float = Field(description="process CPU time / (wall time x threads)")
    machine_busy: float = Field(description="fraction of all cores busy, every process")
    others_busy_cores: float = Field(description="cores' worth of work by other processes")
    loadavg_1m: float | None = None
    device_processes: int | None = Field(None, description="other processes on the GPU (CUDA with NVML)")


class Timing(BaseModel):
    """Every timed step, and what can be concluded from them."""

    steps_s: list[float]
    median_s: float
    tokens_per_step: float | None = Field(None, description="tokens each timed step processed")
    tokens_per_s_ci95: tuple[float, float] = Field(description="95% bootstrap interval of the median tokens/s")
    cv: float | None = Field(description="coefficient of variation of the step times")
    unstable: bool
    unstable_reasons: list[str] = Field(default_factory=list)
    interference: Interference
    rounds: int = Field(1, description="timed rounds run (an unstable round is measured again)")
    setup_s: float | None = Field(None, description="seconds from the trial's fork to its first step: building "
                                  "the model on the meta device and filling the engine's buffers (or reading a "
                                  "checkpoint)")
    host_bytes_at_start: int | None = Field(None, description="the trial's resident memory when its first step "
                                            "starts: the weights and what training keeps beside them, plus the "
                                            "process")


class TrialResult(BaseModel):
    """The design's TrialResult, plus the raw seconds behind the fractions and the top operators. Status diverged:
    the trial ran and was measured, but its step-1 loss is not plain PyTorch's (parity), so its figures are of a
    run that does not train the model correctly."""

    status: Status
    error: str | None = None
    oom_resource: Literal["device", "host"] | None = Field(None, description="what ran out, when status is oom")
    config: TrialConfig
    tokens_per_s: float | None = Field(None, description="the median step's tokens/s")
    step_seconds: float | None = Field(None, description="the median step time")
    timing: Timing | None = None
    peak_device_bytes: int | None = None
    peak_host_bytes: int | None = None
    breakdown: BreakdownFractions | None = None
    io: IOCounters = Field(default_factory=IOCounters)
    breakdown_seconds: dict[str, float] | None = None
    top_ops: list[dict[str, Any]] = Field(default_factory=list)
    profiled_step_seconds: float | None = None
    loss: float | None = None
    trace_path: str | None = None
    wall_seconds: float | None = None
    ranks: list[dict[str, Any]] = Field(default_factory=list, description="per-rank figures when world_size > 1")
    parity: Parity | None = Field(None, description="training trials: the step-1 loss against plain PyTorch's; not "
                                  "ok makes the status diverged")
    backend_detail: dict[str, str] | None = Field(None, description="what the backend chose that its knobs do not "
                                                  "say (DeepSpeed's optimizer: DeepSpeedCPUAdam or torch's)")
    nodes: list[str] | None = Field(None, description="the node each rank ran on, in rank order (its host name; on "
                                    "a Ray cluster with the node's id after it): where the figures come from")

    @model_serializer(mode="wrap")
    def _detail_when_any(self, handler) -> dict[str, Any]:
        out = handler(self)
        for key in ("backend_detail", "nodes"):     # as before there were backends and executors
            if out.get(key, 0) is None:
                del out[key]
        return out

    @model_validator(mode="after")
    def _error_when_not_ok(self) -> "TrialResult":
        if self.status != "ok" and not self.error:
            raise ValueError("a trial that is not ok must say why (error)")
        return self
