"""Isolated, profiled trials: throughput, measured peaks and a time breakdown for one config."""

from typing import TYPE_CHECKING

from sltune.lazy import exports

if TYPE_CHECKING:
    from sltune.profiling.breakdown import SLICES, Breakdown, profile_call
    from sltune.profiling.schema import TrialResult, TrialSpec
    from sltune.profiling.trial import run_trial

__all__ = ["SLICES", "Breakdown", "TrialResult", "TrialSpec", "profile_call", "run_trial"]
__getattr__ = exports(__name__, {"SLICES": "sltune.profiling.breakdown", "Breakdown": "sltune.profiling.breakdown",
                                 "profile_call": "sltune.profiling.breakdown", "TrialResult": "sltune.profiling.schema",
                                 "TrialSpec": "sltune.profiling.schema", "run_trial": "sltune.profiling.trial"})
