"""One-shot tuning: fit resource models from a few probe trials, prune with them, find the fastest config."""

from typing import TYPE_CHECKING

from sltune.lazy import exports

if TYPE_CHECKING:
    from sltune.tuning.plan import plan
    from sltune.tuning.result import best_config, export_yaml
    from sltune.tuning.runner import run_job
    from sltune.tuning.spec import TuningSpec

__all__ = ["TuningSpec", "best_config", "export_yaml", "plan", "run_job"]
__getattr__ = exports(__name__, {"plan": "sltune.tuning.plan", "best_config": "sltune.tuning.result",
                                 "export_yaml": "sltune.tuning.result", "run_job": "sltune.tuning.runner",
                                 "TuningSpec": "sltune.tuning.spec"})
