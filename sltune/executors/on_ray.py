"""The Ray executor: a trial runs on the nodes of a Ray cluster, its ranks forked there as on this machine.

A placement group of N bundles (hardware.nodes, one on one node) of ranks_per_node CPUs (a GPU per rank on cuda) on
N distinct nodes (STRICT_SPREAD) holds the trial's ranks; a task on the first bundle's node names its address and a
port free there, for the process group's store (rank 0 serves it: torch.distributed's TCPStore); then a task on each
bundle forks that node's ranks, in rank order, and waits for them (sltune.profiling.trial.run_ranks). The first node whose
ranks fail ends the trial: the other nodes' tasks are cancelled, which stops their ranks (a rank exits when the
process that waits for it is gone), and the trial fails naming that node.

The cluster's address is given (SLTUNE_RAY_ADDRESS through Settings) or Ray's own RAY_ADDRESS: host:port of its head
(`ray start --head` prints it). A head that does not answer is one line naming the address before any trial; a node
that dies under a trial fails that trial in one line naming the node, and the job goes on. Every node needs sltune,
torch and the model: a trial imports them there."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Callable

from sltune.executors import INSTALL_RAY
from sltune.executors.base import StopFn
from sltune.profiling.schema import TrialResult, TrialSpec

GRACE_S = 60.0          # beyond the trial's own timeout, which its node enforces: the answer on its way back
CONNECT_S = 3.0
PLACE_S = 20.0          # to place a trial's ranks on distinct nodes before it is failed as one the cluster cannot hold


class RayExecutor:
    name = "ray"

    def __init__(self, address: str | None = None):
        try:
            import ray
        except ImportError:
            raise RuntimeError(f"hardware.executor: ray needs Ray installed here: {INSTALL_RAY}") from None
        self.ray = ray
        self.address = reachable(address)
        _connect(ray, self.address)
        self._open = True
        self._share = ray.remote(max_retries=0)(ranks_on_node)
        self._where = ray.remote(max_retries=0)(rendezvous)

    def run(self, spec: TrialSpec, stop: StopFn | None = None) -> TrialResult:
        """The trial's ranks on spec.nodes distinct nodes, per_node on each (one node: a bundle of one)."""
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from sltune.profiling.trial import finished, merge

        per = spec.per_node
        gpus = per if spec.device.startswith("cuda") else 0
        if why := self._no_node_holds(spec.nodes, per, gpus):
            return _failed(spec, why)
        ray, start = self.ray, time.monotonic()
        deadline = start + spec.timeout_s + GRACE_S
        pg = placement_group([{"CPU": per, **({"GPU": gpus} if gpus else {})}] * spec.nodes, strategy="STRICT_SPREAD")
        try:
            if not ray.wait([pg.ready()], timeout=PLACE_S)[0]:
                return _failed(spec, f"the Ray cluster at {self.address} could not place {spec.nodes} nodes' ranks "
                               f"({per} CPUs{f' and {gpus} GPUs' if gpus else ''} on each of {spec.nodes} distinct "
                               f"nodes) within {PLACE_S:g}s: it has fewer such nodes free; lower hardware.nodes or "
                               "add nodes")
            hosts = placement_group_table(pg)["bundles_to_node_id"]

            def on(i: int, task: Any, cpus: int = 0, gpus: int = 0) -> Any:
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                return task.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy)

            master, port = ray.get(on(0, self._where).remote(), timeout=PLACE_S)
            data = spec.model_dump(mode="json")
            refs = {i: on(i, self._share, per, gpus).remote(data, i * per, port, master) for i in range(spec.nodes)}
            outcome = self._wait(refs, spec, stop, deadline, lambda i: f"Ray node {str(hosts[i])[:8]} (ranks "
                                 f"{i * per}-{(i + 1) * per - 1})")
            if isinstance(outcome, TrialResult):
                return outcome
            failed = next(((results, node) for results, node in outcome.values() if isinstance(results, dict)), None)
            if failed is not None:
                results, node = failed
                return finished(spec, {**results, "error": f"on {node}: {results.get('error')}"}, start)
            ranks = [r for i in range(spec.nodes) for r in outcome[i][0]]
            result = finished(spec, merge(ranks), start)
            return result.model_copy(update={"nodes": [outcome[i][1] for i in range(spec.nodes) for _ in range(per)]})
        finally:
            remove_placement_group(pg)

    def _wait(self, refs: dict[int, Any], spec: TrialSpec, stop: StopFn | None, deadline: float,
              who: Callable[[int], str]) -> dict[int, Any] | TrialResult:
        """Each task's answer by its index, or the trial's failure: the first task whose node failed (or whose ranks
        failed: the others are cancelled), `stop`'s reason, or the deadline."""
        ray, answers = self.ray, {}
        index = {ref: i for i, ref in refs.items()}
        pending = list(refs.values())
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=0.5)
                for ref in ready:
                    try:
                        answers[index[ref]] = answer = ray.get(ref)
                    except ray.exceptions.RayError as err:
                        return _failed(spec, f"{who(index[ref])} failed: {_first_line(err)}")
                    if isinstance(answer[0], dict) and answer[0].get("status") not in (None, "ok", "diverged"):
                        return answers              # a node's ranks failed: the others cannot finish
                why = stop() if stop is not None else None
                if why or time.monotonic() > deadline:
                    return _failed(spec, f"stopped: {why}" if why else
                                   f"no answer from the Ray cluster at {self.address} within timeout_s="
                                   f"{spec.timeout_s:g}s and {GRACE_S:g}s more; the trial was cancelled")
            return answers
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)

    def _no_node_holds(self, nodes: int, cpus: int, gpus: int) -> str | None:
        """Why the cluster's live nodes cannot hold the trial's ranks (rather than wait for nodes that never come)."""
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        holds = [n for n in alive if n["Resources"].get("CPU", 0) >= cpus and n["Resources"].get("GPU", 0) >= gpus]
        if len(holds) >= nodes:
            return None
        most = max((int(n["Resources"].get("CPU", 0)) for n in alive), default=0)
        need = f"{cpus} CPUs" + (f" and {gpus} GPUs" if gpus else "")
        if nodes == 1:
            return (f"no node of the Ray cluster at {self.address} has {need} for hardware.world_size {cpus} (the "
                    f"most a node has: {most} CPUs); lower hardware.world_size or add a larger node")
        return (f"the Ray cluster at {self.address} has {len(holds)} nodes with {need} for hardware.nodes {nodes} x "
                f"ranks_per_node {cpus}; lower hardware.nodes or ranks_per_node, or add nodes")

    def close(self) -> None:
        if self._open:
            self._open = False
            _release(self.ray, self.address)


# A process talks to one Ray cluster, through one connection its executors share: a worker running several jobs at
# once (SLTUNE_JOBS_PER_WORKER) holds one executor per job, and the last one closed ends the connection
_LOCK = threading.Lock()
_USERS: dict[str, int] = {}


def _connect(ray: Any, address: str) -> None:
    with _LOCK:
        if _USERS and address not in _USERS:
            raise ValueError(f"this process runs trials on the Ray cluster at {next(iter(_USERS))} already; one "
                             f"process talks to one cluster, and {address} is another (SLTUNE_RAY_ADDRESS)")
        if not _USERS:
            if ray.is_initialized():
                ray.shutdown()      # a connection sltune did not make: the executor's is made to its address
            ray.init(address=address, namespace="sltune", log_to_driver=False, logging_level="ERROR",
                     configure_logging=False)
        _USERS[address] = _USERS.get(address, 0) + 1


def _release(ray: Any, address: str) -> None:
    with _LOCK:
        _USERS[address] -= 1
        if not _USERS[address]:
            del _USERS[address]
            if ray.is_initialized():
                ray.shutdown()


def as_a_trial_runs() -> str | None:
    """This Ray worker set to run a trial as it runs on its own machine, or why it cannot be. Ray starts its workers
    niced (15 by default), where a trial's ranks would get a sliver of a busy node (on 2 cores beside one busy loop,
    a fork server took minutes to import torch): back to the default priority, which root may always do and others
    where the node's raylet was started with RAY_worker_niceness=0. And Ray sets OMP_NUM_THREADS to the task's CPUs:
    a trial takes the threads its spec says, as it does locally."""
    os.environ.pop("OMP_NUM_THREADS", None)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError:
            return (f"this node runs Ray's workers at nice {nice}, where a trial measures a fraction of the machine, "
                    "and this user may not lower it: start the node's raylet with RAY_worker_niceness=0 in its "
                    "environment (RAY_worker_niceness=0 ray start ...)")
    return None


def ranks_on_node(spec_data: dict[str, Any], first: int, port: int,
                  master: str) -> tuple[list[dict[str, Any]] | dict[str, Any], str]:
    """A Ray task's body on one node of a trial: its ranks first.. forked here, and their results in rank order (or
    the first reason there are none), with this node's name."""
    from sltune.profiling.schema import TrialSpec
    from sltune.profiling.trial import ops_not_ready, run_ranks

    spec = TrialSpec.model_validate(spec_data)
    if why := as_a_trial_runs() or ops_not_ready(spec):
        return {"status": "failed", "error": why}, node_name()
    return run_ranks(spec, range(first, first + spec.per_node), port, master), node_name()


def rendezvous() -> tuple[str, int]:
    """On the node of a trial's first ranks: its address and a port free there, for rank 0's store."""
    import ray

    from sltune.loopback import free_port

    return ray.util.get_node_ip_address(), free_port()


def node_name() -> str:
    """This node as a trial's result names it: its host, and the Ray node's id (simulated nodes share a host)."""
    import ray

    return f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"


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
