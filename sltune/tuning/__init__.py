"""One-shot tuning: fit resource models from a few probe trials, prune with them, find the fastest config.

Rooms, each importing only those below it: runner (a job from start to finish) > report (result, compare,
plan) > search (state, fits, strategies, confirmation, study) > cost (shape, prior, admission) > the spec
(spec, space, knobs). .importlinter holds the order and CI checks it."""

from typing import TYPE_CHECKING

from sltune.lazy import exports

if TYPE_CHECKING:
    from sltune.tuning.report.plan_from_fits import plan
    from sltune.tuning.report.result import best_config, export_yaml
    from sltune.tuning.runner import run_job
    from sltune.tuning.spec import TuningSpec

__all__ = ["TuningSpec", "best_config", "export_yaml", "plan", "run_job"]
__getattr__ = exports(__name__, {"plan": "sltune.tuning.report.plan_from_fits",
                                 "best_config": "sltune.tuning.report.result",
                                 "export_yaml": "sltune.tuning.report.result",
                                 "run_job": "sltune.tuning.runner", "TuningSpec": "sltune.tuning.spec"})
