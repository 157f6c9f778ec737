"""What an executor does: run one trial somewhere and always answer with a TrialResult."""

from __future__ import annotations

from typing import Callable, Protocol

from sltune.profiling.schema import TrialResult, TrialSpec

StopFn = Callable[[], str | None]


class Executor(Protocol):
    name: str

    def run(self, spec: TrialSpec, stop: StopFn | None = None, on: str | None = None) -> TrialResult:
        """The trial's result, or why it has none (a timeout, a dead rank or node, `stop`'s reason): never a hang
        or an exception. `on`: the node a result named (TrialResult.nodes), to run a one-node trial there again
        (a confirmation round measures on one machine); one machine's executor has no other."""

    def slots(self, nodes: int, per_node: int, device: str) -> int:
        """How many trials of `nodes` nodes of `per_node` ranks each can run at once, each on nodes of its own."""

    def close(self) -> None:
        """Let go of what the executor holds (a connection to a cluster)."""
