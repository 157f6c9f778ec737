"""PyTorch FSDP2: `fully_shard` on each decoder layer and on the whole model, over a device mesh of the trial's
ranks (a CPU mesh over gloo without a GPU).

Knobs: cpu_offload (CPUOffloadPolicy: the sharded parameters, their gradients and the optimizer's state in
host memory, copied to the device per layer) and reshard_after_forward (free each layer's gathered parameters
after its forward, gathering them again for its backward). The micro-batch and accumulation are as for
DeepSpeed: N micro-batches of b rows, gradients synchronised on the last. bfloat16 runs under a
MixedPrecisionPolicy (float32 sharded parameters, optimizer and gradient reduction, bfloat16 compute); float32
as is; float16 is refused (it would need loss scaling).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from sltune.backends.base import (TrainingSpec, WrappedBackend, checkpoint_activations, full_model, optimizer_tensors,
                                  storage_bytes)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the one ModuleList holding num_hidden_layers blocks (model.layers, h, ...)."""
    count = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return list(module)
    raise ValueError(f"{type(model).__name__}: found no list of its {count} decoder layers to shard")


class FSDPBackend(WrappedBackend):
    name = "fsdp"

    def __init__(self, spec: TrainingSpec):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        super().__init__(spec)
        self.cpu_offload = bool(spec.cpu_offload)
        mixed = spec.dtype == "bfloat16"      # float32 sharded parameters, bfloat16 compute (no pure bfloat16)
        model = full_model(spec, torch.float32)
        if spec.activations == "recompute":
            checkpoint_activations(model)
        model.config.use_cache = False
        model.train()
        if not self.cpu_offload and self.device.type != "cpu":
            model.to(self.device)
        mesh = init_device_mesh(self.device.type, (self.world,))
        options = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward is not False,
                   "offload_policy": CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.cpu_offload
                   else OffloadPolicy()}
        if mixed:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, **options)
        fully_shard(model, **options)
        self.model = model
        self.optimizer = spec.optimizer.build([p for p in model.parameters() if p.requires_grad])

    @property
    def optimizer_on_host(self) -> bool:
        return self.cpu_offload

    def _forward(self, ids: torch.Tensor, index: int) -> torch.Tensor:
        self.model.set_requires_gradient_sync(index == self.n - 1)   # reduce-scatter once, on the last
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss    # no KV cache, whatever the config says

    def _backward(self, loss: torch.Tensor, index: int) -> None:
        (loss / self.n).backward()

    def _update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def device_resident_bytes(self) -> int:
        if self.cpu_offload:
            return 0
        return storage_bytes(list(self.model.parameters()) + list(optimizer_tensors(self.optimizer)))

    def detail(self) -> dict[str, str]:
        mixed = self.spec.dtype == "bfloat16"
        return {"optimizer": f"torch.optim.{type(self.optimizer).__name__}",
                "precision": "MixedPrecisionPolicy(bfloat16)" if mixed else self.spec.dtype,
                "mesh": f"{self.device.type} x{self.world} ({dist.get_backend()})"}


def build(spec: TrainingSpec) -> FSDPBackend:
    return FSDPBackend(spec)
