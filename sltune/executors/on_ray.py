"""The Ray executor: a trial runs on a node of a Ray cluster, its ranks forked there as on this machine (one Ray task
that reserves a CPU per rank, or a GPU per rank on cuda, and calls sltune.profiling.run_trial on its node).

The cluster's address is given (SLTUNE_RAY_ADDRESS through Settings) or Ray's own RAY_ADDRESS: host:port of its head
(`ray start --head` prints it). A head that does not answer is one line naming the address before any trial; a node
that dies under a trial fails that trial in one line naming the node, and the job goes on. Every node needs sltune,
torch and the model: a trial imports them there."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from sltune.executors import INSTALL_RAY
from sltune.executors.base import StopFn
from sltune.profiling.schema import TrialResult, TrialSpec

GRACE_S = 60.0          # beyond the trial's own timeout, which its node enforces: the answer on its way back
CONNECT_S = 3.0


class RayExecutor:
    name = "ray"

    def __init__(self, address: str | None = None):
        try:
            import ray
        except ImportError:
            raise RuntimeError(f"hardware.executor: ray needs Ray installed here: {INSTALL_RAY}") from None
        self.ray = ray
        self.address = reachable(address)
        if ray.is_initialized():
            ray.shutdown()          # another cluster's connection in this process: this executor's is the one
        ray.init(address=self.address, namespace="sltune", log_to_driver=False, logging_level="ERROR",
                 configure_logging=False)
        self._task = ray.remote(max_retries=0)(on_node)

    def run(self, spec: TrialSpec, stop: StopFn | None = None) -> TrialResult:
        ray = self.ray
        gpus = spec.world_size if spec.device.startswith("cuda") else 0
        if why := self._no_node_holds(spec.world_size, gpus):
            return _failed(spec, why)
        ref = self._task.options(num_cpus=spec.world_size, num_gpus=gpus).remote(spec.model_dump(mode="json"))
        deadline = time.monotonic() + spec.timeout_s + GRACE_S
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                try:
                    data, node = ray.get(ref)
                except ray.exceptions.RayError as err:
                    return _failed(spec, f"the Ray node running the trial failed: {_first_line(err)}")
                return TrialResult.model_validate({**data, "nodes": [node] * spec.world_size})
            why = stop() if stop is not None else None
            if why or time.monotonic() > deadline:
                ray.cancel(ref, force=True)
                return _failed(spec, f"stopped: {why}" if why else
                               f"no answer from the Ray cluster at {self.address} within timeout_s="
                               f"{spec.timeout_s:g}s and {GRACE_S:g}s more; the trial was cancelled")

    def _no_node_holds(self, cpus: int, gpus: int) -> str | None:
        """Why no live node of the cluster can run a trial of these ranks (rather than wait for one forever)."""
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        if any(n["Resources"].get("CPU", 0) >= cpus and n["Resources"].get("GPU", 0) >= gpus for n in nodes):
            return None
        most = max((int(n["Resources"].get("CPU", 0)) for n in nodes), default=0)
        return (f"no node of the Ray cluster at {self.address} has {cpus} CPUs"
                + (f" and {gpus} GPUs" if gpus else "") + f" for hardware.world_size {cpus} (the most a node has: "
                f"{most} CPUs); lower hardware.world_size or add a larger node")

    def close(self) -> None:
        if self.ray.is_initialized():
            self.ray.shutdown()


def on_node(spec_data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A Ray task's body, on the node that runs the trial: its result and that node's name. Ray sets
    OMP_NUM_THREADS to the task's CPUs; a trial takes the threads its spec says, as it does locally."""
    import ray

    from sltune.profiling import run_trial

    os.environ.pop("OMP_NUM_THREADS", None)
    node = ray.get_runtime_context().get_node_id()
    return run_trial(spec_data).model_dump(mode="json"), f"{socket.gethostname()}/{node[:8]}"


def reachable(address: str | None) -> str:
    """The cluster's address (`address`, else RAY_ADDRESS) once its head answers there; else one line naming it and
    the fix."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError("hardware.executor: ray needs a cluster: set SLTUNE_RAY_ADDRESS (or RAY_ADDRESS) to "
                         "host:port of its head, which `ray start --head` prints")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"the Ray address {address!r} is not host:port (RAY_ADDRESS or SLTUNE_RAY_ADDRESS)")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_S).close()
    except OSError as err:
        raise ConnectionError(f"no Ray cluster answers at {address} ({err.strerror or err}): start its head there "
                              f"(`ray start --head --port {port}`) or point SLTUNE_RAY_ADDRESS (or RAY_ADDRESS) at "
                              "a running one") from None
    return address


def _failed(spec: TrialSpec, error: str) -> TrialResult:
    return TrialResult.model_validate({"status": "failed", "error": error, "config": spec.knobs()})


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"
