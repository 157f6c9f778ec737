"""What an executor does: run one trial somewhere and always answer with a TrialResult."""

from __future__ import annotations

from typing import Callable, Protocol

from sltune.profiling.schema import TrialResult, TrialSpec

StopFn = Callable[[], str | None]


class Executor(Protocol):
    name: str

    def run(self, spec: TrialSpec, stop: StopFn | None = None) -> TrialResult:
        """The trial's result, or why it has none (a timeout, a dead rank or node, `stop`'s reason): never a hang
        or an exception."""

    def close(self) -> None:
        """Let go of what the executor holds (a connection to a cluster)."""
