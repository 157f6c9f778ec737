"""The Ray executor: a trial runs on the nodes of a Ray cluster, its ranks forked there as on this machine.

A placement group of N bundles (hardware.nodes, one on one node) of ranks_per_node CPUs (a GPU per rank on cuda)
reserves the trial's ranks on N distinct nodes, none running another trial of this process (trials side by side each
on nodes of their own). Each node has a trial host, a Ray actor kept across trials with its fork server warm
(TrialHost); the hosts' pre-flight checks each node can run the trial (the same sltune, torch and transformers as
here, the model's files readable), and the first node's host serves the process group's store (torch.distributed's
TCPStore, at a port the system picks and the host holds: the ranks join it as torchelastic's agent store); then each
host forks its node's ranks, in rank order, and waits for them (sltune.profiling.trial.run_ranks). The first node
whose ranks fail ends the trial: the other nodes' hosts are killed, which stops their ranks (a rank exits when the
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
from pathlib import Path
from typing import Any, Callable

from sltune.executors import INSTALL_RAY
from sltune.executors.base import StopFn
from sltune.profiling.schema import TrialResult, TrialSpec

GRACE_S = 60.0          # beyond the trial's own timeout, which its node enforces: the answer on its way back
CONNECT_S = 3.0
PLACE_S = 20.0          # to place a trial's ranks on distinct nodes before it is failed as one the cluster cannot hold
PREFLIGHT_S = 120.0     # a node's host to answer the pre-flight: a Ray worker that imports sltune and torch first, slow
                        # on a busy node (20 s timed out beside two test suites on 2 cores)
CAUSE_S = 5.0           # a node's ranks failed: how long the other nodes have to say theirs died first


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
        self._Host = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(TrialHost)
        self.versions = versions()

    def run(self, spec: TrialSpec, stop: StopFn | None = None, on: str | None = None) -> TrialResult:
        """The trial's ranks on spec.nodes distinct nodes, per_node on each (one node: a bundle of one); a one-node
        trial `on` a node (its name as node_name gives it) runs there, or fails naming it when it is gone."""
        from ray.util.placement_group import placement_group, remove_placement_group

        from sltune.profiling.trial import finished, merge

        per = spec.per_node
        gpus = per if spec.device.startswith("cuda") else 0
        if why := self._no_node_holds(spec.nodes, per, gpus):
            return _failed(spec, why)
        want = None
        if on is not None and spec.nodes == 1:
            want = self._node_id(on)
            if want is None:
                return _failed(spec, f"the Ray node {on} this trial runs on beside its round's others is gone from "
                                     f"the cluster at {self.address}; run the job again")
        nodes = self._claim(spec.nodes, per, gpus, want)
        if nodes is None:
            return _failed(spec, f"the Ray cluster at {self.address} could not place {spec.nodes} nodes' ranks "
                           f"({per} CPUs{f' and {gpus} GPUs' if gpus else ''} on each of {spec.nodes} distinct "
                           f"nodes) within {PLACE_S:g}s: it has fewer such nodes free; lower hardware.nodes or "
                           "add nodes")
        ray, start = self.ray, time.monotonic()
        deadline = start + spec.timeout_s + GRACE_S
        pg = placement_group([{"CPU": per, **({"GPU": gpus} if gpus else {})}] * spec.nodes, strategy="STRICT_SPREAD",
                             bundle_label_selector=[{"ray.io/node-id": node} for node in nodes])
        try:
            if not ray.wait([pg.ready()], timeout=PLACE_S)[0]:
                return _failed(spec, f"the Ray cluster at {self.address} could not reserve {per} CPUs"
                               f"{f' and {gpus} GPUs' if gpus else ''} on each of its nodes "
                               f"{', '.join(n[:8] for n in nodes)} within {PLACE_S:g}s: something else holds them")
            hosts = [self._host(node) for node in nodes]
            try:
                checks = ray.get([host.preflight.remote(spec.model, serve=i == 0) for i, host in enumerate(hosts)],
                                 timeout=PREFLIGHT_S)
            except ray.exceptions.RayError as err:
                self._retire(nodes)
                return _failed(spec, f"pre-flight: Ray nodes {', '.join(n[:8] for n in nodes)}: "
                                     f"{_first_line(err)}")
            if why := self._refused(checks):
                return _failed(spec, why)
            master, port = checks[0]["address"], checks[0]["port"]
            data = spec.model_dump(mode="json")
            refs = {i: hosts[i].ranks.remote(data, i * per, port, master) for i in range(spec.nodes)}
            outcome = self._wait(refs, nodes, spec, stop, deadline, lambda i: f"Ray node {nodes[i][:8]} (ranks "
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
            with _LOCK:
                _BUSY.difference_update(nodes)

    def _wait(self, refs: dict[int, Any], nodes: list[str], spec: TrialSpec, stop: StopFn | None, deadline: float,
              who: Callable[[int], str]) -> dict[int, Any] | TrialResult:
        """Each node's answer by its index, or the trial's failure: the first node that failed (or whose ranks
        failed: the others' ranks are stopped with their hosts), `stop`'s reason, or the deadline."""
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
                        self._retire([nodes[index[ref]]])
                        return _failed(spec, f"{who(index[ref])} failed: {_first_line(err)}")
                    if isinstance(answer[0], dict) and answer[0].get("status") not in (None, "ok", "diverged"):
                        # a node's ranks failed: the others cannot finish. A node that died makes its peers' ranks
                        # fail too (a connection reset), often before Ray reports the death: that is the cause
                        ready, pending = (ray.wait(pending, num_returns=len(pending), timeout=CAUSE_S) if pending
                                          else ([], []))
                        for dead in ready:
                            try:
                                ray.get(dead)
                            except ray.exceptions.RayError as err:
                                self._retire([nodes[index[dead]]])
                                return _failed(spec, f"{who(index[dead])} failed: {_first_line(err)}")
                        return answers
                why = stop() if stop is not None else None
                if why or time.monotonic() > deadline:
                    return _failed(spec, f"stopped: {why}" if why else
                                   f"no answer from the Ray cluster at {self.address} within timeout_s="
                                   f"{spec.timeout_s:g}s and {GRACE_S:g}s more; the trial was cancelled")
            return answers
        finally:
            # a host still running ranks is killed, and its ranks with it (a rank exits when the process that waits
            # for it is gone); the next trial on its node starts another
            self._retire([nodes[index[ref]] for ref in pending])

    def _claim(self, count: int, cpus: int, gpus: int, want: str | None) -> list[str] | None:
        """`count` live nodes with the CPUs and GPUs, none running another trial of this process (trials side by
        side measure each on a node of its own), those with a warm host first; `want` alone when given. None when
        there are not as many within PLACE_S."""
        deadline = time.monotonic() + PLACE_S
        while True:
            holds = [n["NodeID"] for n in self._holding(cpus, gpus)[1]]
            with _LOCK:
                free = [n for n in holds if n not in _BUSY and (want is None or n == want)]
                free.sort(key=lambda n: (n not in _HOSTS, n))
                if len(free) >= count:
                    _BUSY.update(free[:count])
                    return free[:count]
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)

    def _host(self, node: str) -> Any:
        """The node's trial host: started once and kept, so that its fork server's imports are paid once a node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with _LOCK:
            if node not in _HOSTS:
                _HOSTS[node] = self._Host.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            return _HOSTS[node]

    def _retire(self, nodes: list[str]) -> None:
        """These nodes' hosts killed (their ranks with them) and forgotten: a dead node's, or one whose trial was
        stopped."""
        with _LOCK:
            hosts = [_HOSTS.pop(node) for node in nodes if node in _HOSTS]
        for host in hosts:
            try:
                self.ray.kill(host, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already with its node
                pass

    def _refused(self, checks: list[dict[str, Any]]) -> str | None:
        """The pre-flight's first refusal, one line naming the node and the fix: a node whose sltune, torch or
        transformers differs from this machine's, or that cannot read the model."""
        for check in checks:
            node = f"Ray node {check['node']}"
            for package, here in self.versions.items():
                if check["versions"].get(package) != here:
                    return (f"pre-flight: {node} has {package} {check['versions'].get(package) or 'missing'} where "
                            f"this machine has {here}: install the same versions on every node "
                            f"(bash scripts/install.sh on each)")
            if check["model"]:
                return f"pre-flight: {node} {check['model']}"
        return None

    def slots(self, nodes: int, per_node: int, device: str) -> int:
        gpus = per_node if device.startswith("cuda") else 0
        return len(self._holding(per_node, gpus)[1]) // nodes

    def _node_id(self, name: str) -> str | None:
        """The live node node_name called `name`: its full id."""
        short = name.rpartition("/")[2]
        return next((n["NodeID"] for n in self.ray.nodes() if n.get("Alive") and n["NodeID"].startswith(short)), None)

    def _holding(self, cpus: int, gpus: int) -> tuple[list[dict], list[dict]]:
        """The cluster's live nodes, and those with `cpus` CPUs and `gpus` GPUs."""
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        return alive, [n for n in alive
                       if n["Resources"].get("CPU", 0) >= cpus and n["Resources"].get("GPU", 0) >= gpus]

    def _no_node_holds(self, nodes: int, cpus: int, gpus: int) -> str | None:
        """Why the cluster's live nodes cannot hold the trial's ranks (rather than wait for nodes that never come)."""
        alive, holds = self._holding(cpus, gpus)
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
_HOSTS: dict[str, Any] = {}     # each node's trial host, by node id (sltune.executors.on_ray.TrialHost)
_BUSY: set[str] = set()         # the nodes this process's trials run on now


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
            _HOSTS.clear()          # its actors end with the connection
            _BUSY.clear()
            if ray.is_initialized():
                ray.shutdown()


def as_a_trial_runs() -> str | None:
    """This Ray worker set to run a trial as it runs on its own machine, or why it cannot be. Ray starts its workers
    niced (15 by default), where a trial's ranks would get a sliver of a busy node (on 2 cores beside one busy loop,
    a fork server took minutes to import torch): back to the default priority, which root may always do and others
    where the node's raylet was started with RAY_worker_niceness=0. And Ray sets OMP_NUM_THREADS to the actor's CPUs:
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


class TrialHost:
    """A Ray actor on one node that runs the node's share of each trial, kept across trials: Ray often starts a task's
    worker anew for each placement group, and a trial then paid its fork server's imports (torch, transformers:
    seconds of CPU) again; two trials side by side on a 2-core machine ran 1.12x as fast as one after the other. Its
    niceness and threads set once (as_a_trial_runs), its fork server started on creation and kept."""

    def __init__(self) -> None:
        from sltune.profiling import forks

        self.why = as_a_trial_runs()
        # the ranks join the store a host serves (torch.distributed's env:// rendezvous, as under torchelastic's
        # agent): rank 0 serves none, so the port is held from the pre-flight on, never picked free and let go
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        self.store: Any = None
        forks.start()

    def preflight(self, model: str | dict[str, Any], serve: bool) -> dict[str, Any]:
        """preflight's answer; `serve` (the trial's first node): with the port of a store this host now serves for
        the trial's process group."""
        out = preflight(model)
        if serve:
            from torch.distributed import TCPStore

            self.store = TCPStore(out["address"], 0, is_master=True, wait_for_workers=False)
            out["port"] = self.store.port
        return out

    def ranks(self, spec_data: dict[str, Any], first: int, port: int,
              master: str) -> tuple[list[dict[str, Any]] | dict[str, Any], str]:
        """The node's ranks first.. forked here, and their results in rank order (or the first reason there are
        none), with this node's name."""
        from sltune.profiling.schema import TrialSpec
        from sltune.profiling.trial import ops_not_ready, run_ranks

        spec = TrialSpec.model_validate(spec_data)
        try:
            if why := self.why or ops_not_ready(spec):
                return {"status": "failed", "error": why}, node_name()
            return run_ranks(spec, range(first, first + spec.per_node), port, master), node_name()
        finally:
            self.store = None       # the trial's; the next serves its own


def preflight(model: str | dict[str, Any]) -> dict[str, Any]:
    """On a node of a trial, before its ranks: this node's name and address, the versions it would run, and why it
    cannot read the model (None: it can, or it needs no files: a preset or an inline config)."""
    import ray

    return {"node": node_name(), "address": ray.util.get_node_ip_address(), "versions": versions(),
            "model": unreadable(model)}


def versions() -> dict[str, str | None]:
    """What a trial runs, as installed in this process's environment."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    return {package: of(package) for package in ("sltune", "torch", "transformers")}


def unreadable(model: str | dict[str, Any]) -> str | None:
    """Why this node cannot read the model's files (a folder's config.json, or a config file), or None."""
    from sltune.models import PRESETS

    if not isinstance(model, str) or model in PRESETS:
        return None
    path = Path(model)
    fix = "every node needs the model at the same path; copy it there or mount it on each node"
    if not path.exists():
        return f"cannot read the model at {path} (no such file or folder): {fix}"
    wanted = path / "config.json" if path.is_dir() else path
    if not os.access(wanted, os.R_OK):
        return f"cannot read the model's {wanted} ({'no such file' if not wanted.exists() else 'not readable'}): {fix}"
    return None


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
