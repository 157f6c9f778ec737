"""`sltune train` under a wrapped backend (DeepSpeed ZeRO, PyTorch FSDP2; sltune.backends) instead of SpeedLoader's
engine, so a job trains what its best.yaml says won. The loop and the checkpoints drive an engine; BackendEngine
is one over the backend's own Backend.step, the step a trial timed: N micro-batches of b rows, one optimizer step.

What carries over from SpeedLoader runs: the learning-rate schedule (on the backend's optimizer), --max-grad-norm
(DeepSpeed's gradient_clipping; torch's clip_grad_norm_ over FSDP2's sharded gradients), evaluation, --save (the
full weights gathered into a Hugging Face folder) and, under fsdp, an exact --resume (the optimizer's full state
saved and loaded by parameter name). What does not: --resume of a deepspeed run (its optimizer state lives in ZeRO's
partitions, which sltune's checkpoints do not hold; the loop refuses the flag, and drops the resume state and periodic
checkpoints once the final folder is saved), and a deepspeed run in bfloat16 or float16 saves the weights the model
computes with (DeepSpeed keeps the float32 masters inside its optimizer).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sltune.backends.base import Backend, TrainingSpec
from sltune.backends.fsdp import FSDPBackend
from sltune.config import SpeedLoaderConfig
from sltune.models.checkpoint import untied
from sltune.runtime.engine import StepResult
from sltune.training.optimizer import OptimizerConfig

TIMEOUT_S = 1800.0      # the process group's collective timeout, as a trial's is its own timeout


class BackendEngine:
    """The engine-shaped face of a wrapped backend: train_step, evaluate, optimizer, state_dict, model, as the loop
    and sltune.training.checkpoints use SpeedLoaderEngine's."""

    scaler = None       # DeepSpeed scales float16 losses itself; FSDP2 refuses float16

    def __init__(self, config: SpeedLoaderConfig, model: Any, optimizer: OptimizerConfig, seed: int = 0,
                 max_grad_norm: float | None = None, exact_weights: Path | None = None):
        from sltune.backends import build
        from sltune.models import load_config

        self.config = config
        spec = TrainingSpec.of(config, model=str(model) if isinstance(model, Path) else model, optimizer=optimizer,
                               seed=seed, max_grad_norm=max_grad_norm, timeout_s=TIMEOUT_S)
        use_cache = getattr(load_config(spec.model), "use_cache", True)
        if config.backend == "fsdp":
            self.backend: Backend = _ClippedFSDP(spec)      # clipping between the backward and the step
        else:
            self.backend = build(config.backend, spec)
        self.model = self.backend.model
        # the backend trains without a KV cache (each forward says so); the saved config.json keeps the model's own
        self.model.config.use_cache = use_cache
        self.optimizer: torch.optim.Optimizer = (self.backend.optimizer if config.backend == "fsdp"
                                                 else self.backend.basic_optimizer)
        self.world = dist.get_world_size()
        if exact_weights is not None:
            self._load_exact(exact_weights)

    # -- the loop's calls ----------------------------------------------------------------------------------------
    def train_step(self, ids: torch.Tensor) -> StepResult:
        res = self.backend.step(ids)
        res.grad_norm = self._grad_norm()
        return res

    def evaluate(self, ids: torch.Tensor) -> float:
        """The mean token loss on b*N rows without training, b rows at a time (each has as many tokens), over every
        rank's rows."""
        b = self.config.sub_batch_size
        module = self.backend.engine if self.config.backend == "deepspeed" else self.model
        module.eval()
        try:
            with torch.no_grad():
                losses = [module(input_ids=mb, labels=mb, use_cache=False).loss.float()
                          for mb in ids.to(self.backend.device).split(b)]
        finally:
            module.train()
        total = torch.stack(losses).mean()
        if self.world > 1:
            dist.all_reduce(total)
            total /= self.world
        return float(total)

    @property
    def stepped_dtype(self) -> torch.dtype:
        """The dtype of the weights state_dict() returns: FSDP2's float32 sharded parameters (bfloat16 is its compute
        dtype only); DeepSpeed's model copy (in the precision section's dtype)."""
        if self.config.backend == "fsdp":
            return torch.float32
        return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(self.config.dtype, torch.float32)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights under the model's own names, on the host (a collective: every rank calls it; under fsdp
        rank 0 alone gets them, as only rank 0 writes the model)."""
        if self.config.backend == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        import deepspeed

        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=self.config.zero_stage == 3):
            return {name: t.detach().to("cpu", copy=True) for name, t in self.model.state_dict().items()}

    def untied(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state_dict with a tied weight once, under its first name, as transformers saves it."""
        return untied(self.model, state)

    def optimizer_state(self) -> dict[str, Any] | None:
        """What a resume loads (load_optimizer_state): FSDP2's full optimizer state by parameter name (rank 0's; the
        others' empty); None under deepspeed, which cannot resume."""
        if self.config.backend != "fsdp":
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # the saved groups' settings the fresh optimizer lacks (the schedule's initial_lr): set first, or the load
        # refuses them as another optimizer's; rank 0's, on every rank
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in state.get("param_groups", [])]]
        if self.world > 1:
            dist.broadcast_object_list(groups, src=0)
        for group, saved in zip(self.optimizer.param_groups, groups[0]):
            for key, value in saved.items():
                group.setdefault(key, value)
        set_optimizer_state_dict(self.model, self.optimizer, state,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world > 1))

    def close(self) -> None:
        self.backend.close()

    # -- inside ----------------------------------------------------------------------------------------------------
    def _grad_norm(self) -> float | None:
        if self.config.backend == "fsdp":
            return self.backend.grad_norm
        norm = self.backend.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def _load_exact(self, file: Path) -> None:
        """The float32 weights a resumed fsdp checkpoint kept beside a folder saved in another dtype."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = load_file(file) if dist.get_rank() == 0 else {}
        state = {**state, **{name: state[kept] for name, kept in self._tied_names().items() if kept in state}}
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True,
                                                                          broadcast_from_rank0=self.world > 1))

    def _tied_names(self) -> dict[str, str]:
        """Each tied parameter's later names -> its first (what untied() keeps)."""
        first: dict[int, str] = {}
        out = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                out[name] = first[id(p)]
            else:
                first[id(p)] = name
        return out


class _ClippedFSDP(FSDPBackend):
    """FSDP2 with the global gradient norm measured (and clipped to max_grad_norm when given) before each optimizer
    step: the norm over every rank's shard of every gradient, as the loop logs it for SpeedLoader's engine."""

    grad_norm: float | None = None

    def _update(self) -> None:
        grads = [p for p in self.model.parameters() if p.grad is not None]
        limit = self.spec.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(grads, limit if limit else math.inf)
        full = getattr(norm, "full_tensor", None)       # a DTensor's norm: the value over every rank
        self.grad_norm = float(full() if full is not None else norm)
        super()._update()
