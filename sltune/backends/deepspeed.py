"""DeepSpeed ZeRO through `deepspeed.initialize`: stage 2 or 3, the optimizer's state and (stage 3) the parameter
partitions optionally offloaded to host memory or NVMe.

The micro-batch is sub_batch_size rows and gradient_accumulation_steps is num_sub_batches, so one step is one
optimizer step on b*N rows, as SpeedLoader's. Precision follows the spec: a bf16 or fp16 section (DeepSpeed
keeps float32 masters under either). The optimizer is the spec's: DeepSpeedCPUAdam where the optimizer is
offloaded and its op loads (prebuilt with DS_BUILD_CPU_ADAM=1, or built on first use), torch's otherwise;
`detail()` says which. On a machine without a GPU, DeepSpeed runs on its CPU accelerator (DS_ACCELERATOR=cpu)
over gloo.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from sltune.backends.base import (TrainingSpec, WrappedBackend, checkpoint_activations, full_model, optimizer_tensors,
                                  storage_bytes)
from sltune.backends.deepspeed_ops import INSTALL, accelerator_of, missing, remember_cpu_info
from sltune.backends.export import NO_CLIPPING, ds_config  # noqa: F401 - the trial's config, written by export too



# what DeepSpeed prints each time a process sets up, which says nothing a user acts on
NOISE = ("built successfully",)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """DeepSpeed and its op builder print progress to stdout; a trial's stdout may be `sltune profile --json`'s,
    so while DeepSpeed sets up, what it prints goes to stderr, but for its routine lines (NOISE), which would
    otherwise fill a tuning job's output once per trial."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as printed:
        os.dup2(printed.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            printed.seek(0)
            lines = printed.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not any(n in line for n in NOISE)))
            sys.stderr.flush()


def import_deepspeed(device: str) -> Any:
    """deepspeed on the accelerator the trial's device asks for (its CPU accelerator without a GPU), quiet."""
    os.environ["DS_ACCELERATOR"] = "cuda" if device.startswith("cuda") else "cpu"
    with stdout_to_stderr():
        import deepspeed
    remember_cpu_info()         # DeepSpeedCPUAdam's py-cpuinfo: a second's busy-wait a rank, asked once a CPU
    log = logging.getLogger("DeepSpeed")      # its handler writes to stdout: warnings go to stderr instead
    log.setLevel(logging.WARNING)
    for handler in log.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    # DeepSpeed 0.19 calls collectives torch 2.13 renamed: a FutureWarning per call
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    return deepspeed


def deepspeed_adam(device: str, say: Callable[[str], None] | None = None) -> dict[str, Callable[[list], object]]:
    """DeepSpeedCPUAdam by the name calibrate times it under ("deepspeed.cpu_adam"), where DeepSpeed's install built
    it (never compiled here: that is minutes); none where it is missing, saying so through `say`."""
    accelerator = accelerator_of(device)
    if missing(["cpu_adam"], accelerator):
        if say is not None:
            say(f"DeepSpeedCPUAdam is not built here: not timed ({INSTALL} builds it)")
        return {}
    adam = import_deepspeed(device).ops.adam.DeepSpeedCPUAdam
    return {"deepspeed.cpu_adam": lambda params: adam(params, lr=1e-3)}


def cpu_adam(params: list[torch.nn.Parameter], optimizer: Any) -> tuple[torch.optim.Optimizer | None, str]:
    """DeepSpeedCPUAdam with the spec's AdamW settings (torch's default weight decay where it gives none), or
    None and why its op did not load."""
    try:
        with stdout_to_stderr():
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            decay = 0.01 if optimizer.weight_decay is None else optimizer.weight_decay
            return DeepSpeedCPUAdam(params, lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps,
                                    weight_decay=decay, adamw_mode=True), ""
    except Exception as err:        # noqa: BLE001 - a missing compiler, a failed build: fall back, saying why
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return None, f"its CPU Adam op did not load ({first[:200]})"


class DeepSpeedBackend(WrappedBackend):
    name = "deepspeed"

    def __init__(self, spec: TrainingSpec):
        deepspeed = import_deepspeed(spec.device)
        super().__init__(spec)
        self.offload_optimizer = (spec.offload_optimizer or "none") != "none"
        self.offload_param = (spec.offload_param or "none") != "none"
        model = full_model(spec, torch.float32)         # DeepSpeed casts to the precision section's dtype itself
        if spec.activations == "recompute":
            checkpoint_activations(model)
        model.config.use_cache = False
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt, why = None, ""
        if self.offload_optimizer and spec.optimizer.name == "adamw":
            opt, why = cpu_adam(params, spec.optimizer)
        if opt is None:
            opt = spec.optimizer.build(params)
            reason = "" if not why else f"; DeepSpeedCPUAdam not used: {why}"
            self.optimizer_name = f"torch.optim.{type(opt).__name__}{reason}"
        else:
            self.optimizer_name = "DeepSpeedCPUAdam"
        self.basic_optimizer = opt
        config = ds_config(spec, self.world, model.config.hidden_size)
        with stdout_to_stderr():
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        self.model = self.engine.module
        self.version = deepspeed.__version__

    @property
    def optimizer_on_host(self) -> bool:
        return self.offload_optimizer

    def _forward(self, ids: torch.Tensor, index: int) -> torch.Tensor:
        return self.engine(input_ids=ids, labels=ids, use_cache=False).loss   # no KV cache, whatever the config says

    def _backward(self, loss: torch.Tensor, index: int) -> None:
        self.engine.backward(loss)      # divided by gradient_accumulation_steps: the mean over the step's rows
        if index < self.n - 1:          # DeepSpeed counts micro-batches in step(); it steps the optimizer only
            self.engine.step()          # at the accumulation boundary, the last micro-batch's (_update)

    def _update(self) -> None:
        self.engine.step()

    def device_resident_bytes(self) -> int:
        params = []
        if not self.offload_param:
            for p in self.model.parameters():
                params.append(p.ds_tensor if hasattr(p, "ds_tensor") else p)
        # the optimizer's tensors, and ZeRO-3's float32 master partitions, which its basic optimizer does not hold
        state = [] if self.offload_optimizer else [*optimizer_tensors(self.basic_optimizer),
                                                   *getattr(self.engine.optimizer, "fp32_partitioned_groups_flat", [])]
        return storage_bytes(params + state)

    def detail(self) -> dict[str, str]:
        return {"optimizer": self.optimizer_name, "deepspeed": self.version,
                "precision": {"bfloat16": "bf16", "float16": "fp16"}.get(self.spec.dtype, "fp32")}

    def close(self) -> None:
        with contextlib.suppress(Exception):    # a failed step may leave it half torn down; the trial's own
            self.engine.destroy()               # error is the one to report
        super().close()


def build(spec: TrainingSpec) -> DeepSpeedBackend:
    return DeepSpeedBackend(spec)
