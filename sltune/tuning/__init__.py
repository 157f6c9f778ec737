"""One-shot tuning: fit resource models from a few probe trials, prune with them, find the fastest config."""

from sltune.tuning.plan import plan
from sltune.tuning.result import best_config, export_yaml
from sltune.tuning.runner import run_job
from sltune.tuning.spec import TuningSpec

__all__ = ["TuningSpec", "best_config", "export_yaml", "plan", "run_job"]
