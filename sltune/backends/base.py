"""What every backend offers a trial, and what the wrapped ones (DeepSpeed, FSDP) share.

A backend trains one model on b*N-row steps. The trial builds it by name, steps it, times the steps, profiles
one, reads its peaks: the same code for every backend, so their figures compare. SpeedLoader's engine
labels its own phases; a wrapped backend labels the phases it drives (forward and backward as compute, the
optimizer step as cpu when the optimizer lives on the host), and the breakdown finds the wrapper's
collectives inside them by name.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from sltune.backend_knobs import BackendChoice
from sltune.loopback import free_port
from sltune.runtime.counters import IOCounters
from sltune.runtime.engine import StepResult
from sltune.runtime.memory import CpuAllocationTracker, DeviceMemory, monitor_for
from sltune.runtime.regions import region, step_region

# Tests only: each micro-batch's loss is multiplied by this before the backward and in the reported loss, a
# backend's wrong accumulation scale, so a test can show that parity catches one. Read when a backend is built.
LOSS_SCALE_FAULT_ENV = "SLTUNE_TEST_LOSS_SCALE_FAULT"


@dataclass(frozen=True)
class TrainingSpec(BackendChoice):
    """What a backend reads, one declaration: a trial's spec (sltune.profiling.schema.TrialSpec) or a training job's
    config (sltune.config.SpeedLoaderConfig) gives it its fields with TrainingSpec.of; the backend and its knobs
    are BackendChoice's."""

    model: str | dict[str, Any]
    optimizer: Any                  # sltune.training.optimizer.OptimizerConfig: name, lr, betas, eps, build()
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    mixed_precision: bool = True
    sub_batch_size: int = 1
    num_sub_batches: int = 1
    num_live_blocks: int = 1
    schedule: str = "speedloader"
    activations: str = "recompute"
    mode: str = "train"
    kv_cache: str = "host"
    weights_on_device: float = 0.0
    optimizer_offload: str = "host"
    param_offload: str = "host"
    offload_dir: str | None = None
    disk_versions: int = 2
    device_memory_limit: int | None = None
    timeout_s: float = 600.0        # the process group's collective timeout
    num_layers: int | None = None
    max_grad_norm: float | None = None      # a training job's clipping; a trial does not clip

    @classmethod
    def of(cls, source: Any, **given: Any) -> TrainingSpec:
        """Each field `source` has, then `given` (what it has not: a config has no model, optimizer or seed)."""
        have = {f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)}
        return cls(**{**have, **given})


class Backend(ABC):
    """One way of training a model, as a trial drives it."""

    name: ClassVar[str]
    model: nn.Module                # the transformers model (its config: vocabulary, layers)
    measured_steps: ClassVar[int] = 1
    """The first steps of each batch shape whose device peak is measured (a trial warms up through them): one where
    the first step holds what every later one does."""

    @abstractmethod
    def step(self, ids: torch.Tensor) -> StepResult:
        """One optimizer step on b*N rows (labels: the rows themselves); its loss is the mean token loss over the
        rows of every rank. The device peak is measured on the first measured_steps steps of each batch shape."""

    def detail(self) -> dict[str, str]:
        """What the backend chose that its knobs do not say (the optimizer that stepped, say); {} for none."""
        return {}

    def close(self) -> None:
        """Release what the backend started (a process group of its own); nothing by default."""
        return None


def model_folder(model: Any) -> str | None:
    """The Hugging Face folder a spec's model is (not a preset's name, an inline config or a config.json)."""
    from sltune.models import PRESETS

    if not isinstance(model, str) or model in PRESETS or not os.path.isdir(model):
        return None
    return model


def initial_weights(spec: TrainingSpec) -> tuple[Any, Any]:
    """(config, weights) of the spec's model at step 0: a folder's checkpoint (None: a folder without weights,
    initialised by transformers from the seed) or seeded weights for a preset, a config, or a reduced depth."""
    from sltune.models import load_config, with_layers
    from sltune.models.checkpoint import Checkpoint
    from sltune.models.seeded import SeededWeights

    folder = model_folder(spec.model)
    if folder is not None and spec.num_layers is None:
        checkpoint = Checkpoint(folder)
        return checkpoint.config, checkpoint if checkpoint.has_weights else None
    config = load_config(spec.model)
    if spec.num_layers is not None:
        config = with_layers(config, spec.num_layers)
    return config, SeededWeights(config, spec.seed)


def full_model(spec: TrainingSpec, dtype: torch.dtype) -> nn.Module:
    """The spec's model with its step-0 weights, every parameter in `dtype` on the host; buffers keep theirs, as
    in a transformers model loaded in that dtype (rotary frequencies stay float32). The same weights as
    SpeedLoader's engine starts from, so every backend trains, and the reference checks, one model."""
    from sltune.models import build

    config, weights = initial_weights(spec)
    if weights is None:     # a folder with only config.json: transformers' init from the seed, as the engine does
        model = build(config, seed=spec.seed)
        for p in model.parameters():
            p.data = p.data.to(dtype)
        return model
    model = weights.empty_model()
    made: dict[int, nn.Parameter] = {}
    with weights.reader(model) as fill:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in made:           # tied weights stay one parameter
                    data = torch.empty(p.shape, dtype=dtype)
                    fill(p, data)
                    made[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
    return model


def checkpoint_activations(model: nn.Module) -> None:
    """Activation checkpointing, transformers' own (each decoder layer's forward rerun in its backward)."""
    enable = getattr(model, "activation_checkpointing_enable", None)     # transformers 5; before: the old name
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def storage_bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind these tensors (views and tied weights counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        local = getattr(t, "_local_tensor", t)          # a DTensor's shard on this rank
        st = local.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def optimizer_tensors(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters an optimizer steps and its state tensors."""
    for group in opt.param_groups:
        yield from group["params"]
    for state in opt.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class _ShardAwareTracker(CpuAllocationTracker):
    """The runtime's CPU allocation tracker, counting a DTensor's (FSDP2's sharded parameters, gradients and
    optimizer state) local shard: the wrapper itself has no storage, and the ops on its shard run below the mode."""

    def _count(self, t: torch.Tensor) -> None:
        local = getattr(t, "_local_tensor", None)
        super()._count(local if isinstance(local, torch.Tensor) else t)


def device_monitor(device: torch.device, limit: int | None) -> DeviceMemory:
    """The device's measured peak and enforced limit: the CUDA allocator's, or what a step allocates on the CPU."""
    return monitor_for(device, limit) if device.type == "cuda" else _ShardAwareTracker(limit, str(device))


class _OwnGroup:
    """A one-rank process group for a trial of one rank: DeepSpeed and FSDP2 run on torch.distributed even
    alone. A multi-rank trial's group is the trial's own (its ranks joined before the backend is built)."""

    def __init__(self, device: str, timeout_s: float):
        self.started = False
        if dist.is_initialized():     # the trial's ranks set their local rank when they joined; else one machine's
            os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
            os.environ.setdefault("LOCAL_WORLD_SIZE", str(dist.get_world_size()))
            return
        port = free_port()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        kind = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(kind, rank=0, world_size=1, timeout=datetime.timedelta(seconds=max(30.0, timeout_s)))
        self.started = True

    def close(self) -> None:
        if self.started and dist.is_initialized():
            dist.destroy_process_group()
        self.started = False


class WrappedBackend(Backend):
    """A transformers model under a training wrapper: N micro-batches of b rows per optimizer step, the loss of
    each divided by N (gradient accumulation), activation checkpointing under activations recompute and
    autograd's saved tensors in host memory under offload, every phase labelled for the breakdown."""

    # a torch optimizer makes its state at its first step: the second is the first whose backward holds it, as
    # every later one does (ZeRO-3 on a qwen2 shape at b=4 measured 18.0 bytes a parameter at its first step and
    # 20.6 at its second)
    measured_steps: ClassVar[int] = 2

    def __init__(self, spec: TrainingSpec):
        self.spec = spec
        self.b, self.n = spec.sub_batch_size, spec.num_sub_batches
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":      # "cuda": this rank's GPU (a multi-rank trial set it when joining)
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.group = _OwnGroup(spec.device, spec.timeout_s)
        self.world = dist.get_world_size()
        self.memory = device_monitor(self.device, spec.device_memory_limit)
        self._shapes: collections.Counter[tuple[int, ...]] = collections.Counter()
        self._fault = float(os.environ.get(LOSS_SCALE_FAULT_ENV, "1"))

    def close(self) -> None:
        self.group.close()

    # what a backend fills in
    @abstractmethod
    def _forward(self, ids: torch.Tensor, index: int) -> torch.Tensor:
        """Micro-batch `index`'s mean token loss (a graph to run backward on)."""

    @abstractmethod
    def _backward(self, loss: torch.Tensor, index: int) -> None:
        """Gradients of the loss over the whole step (this micro-batch's loss divided by N)."""

    @abstractmethod
    def _update(self) -> None:
        """The optimizer step on the accumulated gradients, and the gradients zeroed."""

    @property
    @abstractmethod
    def optimizer_on_host(self) -> bool:
        """Whether the optimizer steps host-resident state (its time is the breakdown's cpu slice)."""

    @abstractmethod
    def device_resident_bytes(self) -> int:
        """On the CPU, the bytes the backend keeps on its device between steps: parameters and optimizer state
        its knobs do not offload (measured storages). On CUDA the allocator's figure already holds them."""

    def _activations(self) -> contextlib.AbstractContextManager:
        if self.spec.activations == "offload":     # recompute is the model's gradient checkpointing, set at build
            return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")
        return contextlib.nullcontext()

    def step(self, ids: torch.Tensor) -> StepResult:
        start = time.perf_counter()
        ids = ids.to(self.device)
        measured = self._shapes[tuple(ids.shape)] < self.measured_steps   # a step whose device peak is measured
        self._shapes[tuple(ids.shape)] += 1
        resident = 0
        if measured and self.device.type == "cpu":     # counted afresh: what an earlier step left is in the resident
            self.memory = device_monitor(self.device, self.spec.device_memory_limit)
            resident = self.device_resident_bytes()
        self.memory.alloc(resident)
        try:
            with step_region(), self.memory.tracking(measured):
                losses = []
                for i in range(self.n):
                    mb = ids[i * self.b:(i + 1) * self.b]
                    with self._activations():
                        with region("compute", "forward"):
                            loss = self._forward(mb, i)
                            if self._fault != 1.0:
                                loss = loss * self._fault
                        with region("compute", "backward"):
                            self._backward(loss, i)
                    losses.append(loss.detach().float())
                with region("cpu" if self.optimizer_on_host else "compute", "optimizer"), \
                        (self.memory.paused() if self.optimizer_on_host else contextlib.nullcontext()):
                    self._update()
                total = torch.stack(losses).mean()
                if self.world > 1:          # the mean over every rank's rows (each rank has as many tokens)
                    dist.all_reduce(total)
                    total /= self.world
                loss_value = float(total)
        finally:
            self.memory.free(resident)
        peak = self.memory.peak if measured else None
        return StepResult(loss=loss_value, tokens=ids.numel(), seconds=time.perf_counter() - start,
                          io=IOCounters(), peak_device_bytes=peak)
