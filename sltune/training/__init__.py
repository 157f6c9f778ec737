"""What a training job needs around the runtime: the optimizer section, learning-rate schedules,
Hugging Face checkpoints in and out, resumable state, text data and the loop that ties them together."""

from sltune.training.optimizer import OptimizerConfig

__all__ = ["OptimizerConfig"]
