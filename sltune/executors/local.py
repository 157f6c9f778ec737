"""The local executor: the trial's ranks forked on this machine (sltune.profiling.run_trial)."""

from __future__ import annotations

import socket

from sltune.executors.base import StopFn
from sltune.profiling import run_trial
from sltune.profiling.schema import TrialResult, TrialSpec


class LocalExecutor:
    name = "local"

    def run(self, spec: TrialSpec, stop: StopFn | None = None, on: str | None = None) -> TrialResult:
        result = run_trial(spec, stop)
        return result.model_copy(update={"nodes": [socket.gethostname()] * spec.world_size})

    def slots(self, nodes: int, per_node: int, device: str) -> int:
        return 1            # trials side by side on one machine would measure each other

    def close(self) -> None:
        pass
