"""Where a trial runs, behind one interface chosen by name as storages and backends are: `local` (this machine's
fork server, the default) or `ray` (a node of a Ray cluster: `pip install -e '.[ray]'`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sltune.executors.base import Executor

EXECUTORS = ("local", "ray")
INSTALL_RAY = "pip install -e '.[ray]'"


def executor_for(name: str, address: str | None = None) -> "Executor":
    """The executor named `name`; `address`: a Ray cluster's (default RAY_ADDRESS, then SLTUNE_RAY_ADDRESS)."""
    if name == "local":
        from sltune.executors.local import LocalExecutor

        return LocalExecutor()
    if name == "ray":
        from sltune.executors.on_ray import RayExecutor

        return RayExecutor(address)
    raise ValueError(f"hardware.executor: {name!r} is not an executor; use one of {', '.join(EXECUTORS)}")
