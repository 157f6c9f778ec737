"""Named model presets (transformers configs, random weights) and loading configs from files.

There is no model hub on the machines this runs on: a model is a transformers config, built with
random weights or loaded by the user. Presets give tests and benchmarks fixed, reproducible shapes.
"""

from sltune.models.presets import PRESETS, Preset, build, load_config, param_count, with_layers

__all__ = ["PRESETS", "Preset", "build", "load_config", "param_count", "with_layers"]
