"""The local executor: the trial's ranks forked on this machine (sltune.profiling.run_trial)."""

from __future__ import annotations

import socket

from sltune.executors.base import StopFn
from sltune.profiling import run_trial
from sltune.profiling.schema import TrialResult, TrialSpec


class LocalExecutor:
    name = "local"

    def run(self, spec: TrialSpec, stop: StopFn | None = None) -> TrialResult:
        result = run_trial(spec, stop)
        return result.model_copy(update={"nodes": [socket.gethostname()] * spec.world_size})

    def close(self) -> None:
        pass
