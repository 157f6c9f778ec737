"""SpeedLoader's own engine, as trials have always built it: a preset or config on the meta device with its
buffers filled from seeded weights, or a model folder read straight into the engine's buffers."""

from __future__ import annotations

import torch

from sltune.backends.base import Backend, TrainingSpec, initial_weights, model_folder
from sltune.runtime.engine import StepResult


class SpeedLoaderBackend(Backend):
    name = "speedloader"

    def __init__(self, spec: TrainingSpec):
        from sltune.config import SpeedLoaderConfig
        from sltune.runtime import engine as engine_module  # looked up now: tests record the engine built

        cfg = SpeedLoaderConfig(sub_batch_size=spec.sub_batch_size, num_sub_batches=spec.num_sub_batches,
                                num_live_blocks=spec.num_live_blocks, schedule=spec.schedule,
                                activations=spec.activations, device=spec.device,
                                dtype=spec.dtype, mixed_precision=spec.mixed_precision,
                                device_memory_limit=spec.device_memory_limit,
                                kv_cache=spec.kv_cache, weights_on_device=spec.weights_on_device,
                                optimizer_offload=spec.optimizer_offload if spec.mode == "train" else "host",
                                param_offload=spec.param_offload,
                                offload_dir=spec.offload_dir, disk_versions=spec.disk_versions)
        train = spec.mode == "train"
        optimizer = spec.optimizer.factory if train else None     # the optimizer the training job will step with
        engine_cls = engine_module.SpeedLoaderEngine
        folder = model_folder(spec.model)
        if folder is not None and spec.num_layers is None:   # its weights into the engine's host buffers (none: seeded)
            self.engine = engine_cls.from_pretrained(folder, cfg, optimizer=optimizer, seed=spec.seed)
        else:   # a preset or a config: built on the meta device, the engine's buffers filled in place, each once
            _, weights = initial_weights(spec)
            self.engine = engine_cls(weights.empty_model(), cfg, optimizer=optimizer, weights=weights)
        self.model = self.engine.model

    def step(self, ids: torch.Tensor) -> StepResult:
        return self.engine.train_step(ids)


def build(spec: TrainingSpec) -> SpeedLoaderBackend:
    return SpeedLoaderBackend(spec)
