"""Isolated, profiled trials: throughput, measured peaks and a time breakdown for one config."""

from sltune.profiling.breakdown import SLICES, Breakdown, profile_call
from sltune.profiling.schema import TrialResult, TrialSpec
from sltune.profiling.trial import run_trial

__all__ = ["SLICES", "Breakdown", "TrialResult", "TrialSpec", "profile_call", "run_trial"]
