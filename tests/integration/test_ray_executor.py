"""Trials on a real Ray cluster (sltune.executors, hardware.executor ray): a local cluster of simulated nodes
(ray.cluster_utils.Cluster: a head that runs nothing and two worker nodes of 2 CPUs each, on this machine), real
trials on them, a real tuning job whose trials run there. Ray is the optional extra `ray` (the test install has it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sltune.executors import executor_for
from sltune.loopback import free_port
from sltune.profiling import run_trial
from sltune.profiling.schema import TrialSpec
from sltune.service.local import tune
from sltune.settings import Settings
from sltune.store import Store
from tests.support.deepspeed import needs_deepspeed

ray = pytest.importorskip("ray", reason="Ray is the optional extra ray: pip install -e '.[ray]' (scripts/install.sh "
                                        "test installs it)")


def head() -> dict:
    """A head that runs no task (trials land on worker nodes), on a port of its own (6379, Ray's default, is Redis's
    on this machine)."""
    return {"num_cpus": 0, "include_dashboard": False, "gcs_server_port": free_port()}


TRIAL = dict(model="llama-tiny", seq_len=16, steps=1, min_time_s=0.0, max_steps=1, remeasure=0, profile=False)


@pytest.fixture(scope="module", autouse=True)
def cluster_settings():
    """The nodes' raylets start their workers at the default priority, as a cluster for trials should be started
    (docs/guides/ray.md): the executor needs no root to lower Ray's nice 15. And the head notices a dead node within
    about 2 s (a health check every 0.5 s, three missed), not Ray's 15 s and more: the tests that remove a node wait
    for that, not for the executor."""
    settings = {"RAY_worker_niceness": "0", "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
                "RAY_health_check_failure_threshold": "3"}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in settings.items():
            mp.setenv(name, value)
        yield


def test_a_cluster_that_does_not_answer_is_one_line_naming_its_address(tmp_path):
    """Within seconds: from the executor, and from `sltune tune`, which refuses the spec before any job or trial
    (a server's worker fails the job with the same line)."""
    import yaml

    from sltune.store import Store
    from tests.support.cli import sltune

    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"no Ray cluster answers at {address}.*ray start --head"):
        executor_for("ray", address)
    assert time.monotonic() - start < 10
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "no-ray", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 16},
        "hardware": {"executor": "ray"},
        "search": {"strategy": "grid", "sub_batch_size": [1], "num_sub_batches": [1], "num_live_blocks": [1]}}))
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    out = sltune("tune", str(spec), "--db", db, env={"SLTUNE_RAY_ADDRESS": address,
                                                     "SLTUNE_DATA_DIR": str(tmp_path / "data")})
    assert out.returncode != 0 and out.stderr.strip().splitlines() == [
        f"sltune tune: error: no Ray cluster answers at {address} (Connection refused): start its head there (`ray "
        f"start --head --port {address.split(':')[1]}`) or point SLTUNE_RAY_ADDRESS (or RAY_ADDRESS) at a running "
        "one"], out.stderr
    assert Store(db).jobs() == []


def test_a_node_that_dies_under_a_trial_fails_it_on_every_rank_in_one_line(tmp_path):
    """A cluster of its own, two worker nodes whose workers Ray niced (the executor sets its tasks back to the default
    priority), a trial over both (timed for 60 s): one node's raylet is removed while its steps run. The trial fails
    within seconds naming that node, the other node's rank is stopped with it (no process of the trial is left), and
    the executor runs the next trial once a node has replaced it."""
    import threading

    import psutil
    from ray.cluster_utils import Cluster

    os.environ["RAY_worker_niceness"] = "15"        # Ray's default: the executor lowers it, as root may
    try:
        c = Cluster(initialize_head=True, head_node_args=head())
        nodes = [c.add_node(num_cpus=1, include_dashboard=False) for _ in range(2)]
        c.wait_for_nodes()
    finally:
        os.environ["RAY_worker_niceness"] = "0"
    executor = executor_for("ray", c.address)
    try:
        if os.geteuid() != 0:           # others may not: the trial says how the nodes should be started instead
            result = executor.run(TrialSpec(**TRIAL))
            assert result.status == "failed" and "RAY_worker_niceness=0" in result.error, result
            return
        out = {}
        spec = TrialSpec(**{**TRIAL, "steps": 1000, "max_steps": 1000, "min_time_s": 60.0}, world_size=2, nodes=2)
        runs = threading.Thread(target=lambda: out.update(result=executor.run(spec)))
        runs.start()
        started = time.monotonic()
        while len(ranks := trial_ranks(nodes)) < 2:     # both nodes' fork servers up (slow beside other work)
            assert time.monotonic() - started < 240 and runs.is_alive(), (ranks, out)
            time.sleep(0.5)
        time.sleep(3)                   # both ranks are stepping
        killed = time.monotonic()
        # a node other than the one this process's Ray driver is attached to (removing that one breaks the driver)
        driver = ray.get_runtime_context().get_node_id()
        c.remove_node(next(n for n in nodes if n.node_id != driver), allow_graceful=False)
        runs.join(60)
        assert not runs.is_alive() and time.monotonic() - killed < 30
        result = out["result"]
        assert result.status == "failed" and result.error.startswith("Ray node ") and " failed: " in result.error
        assert "\n" not in result.error
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in ranks):
            assert time.monotonic() < deadline, f"a rank outlived its trial: {ranks}"
            time.sleep(0.2)
        c.add_node(num_cpus=1, include_dashboard=False)
        c.wait_for_nodes()
        assert executor.run(TrialSpec(**TRIAL, world_size=2, nodes=2)).status == "ok"
    finally:
        executor.close()
        connected = ray.is_initialized()
        c.shutdown()
    assert not connected, "the process's last executor closed, and its connection to the cluster stayed open"


def trial_ranks(nodes: list) -> set[int]:
    """The trial processes these nodes' Ray workers forked: the children of the fork servers their tasks started.
    Only theirs: another test file may run a Ray cluster of its own on this machine at the same time (xdist), and
    its trial's ranks counted here had this test remove a node while its own trial was still in pre-flight."""
    import psutil

    raylets = {info.process.pid for node in nodes for info in node.all_processes.get("raylet", [])}
    assert len(raylets) == len(nodes), "a node's raylet process is not where ray.cluster_utils keeps it"
    pids = set()
    for server in psutil.process_iter(["cmdline"]):
        if "multiprocessing.forkserver" not in " ".join(server.info["cmdline"] or []):
            continue
        try:
            worker = server.parent()
            if "ray::" in " ".join(worker.cmdline()) and raylets & {p.pid for p in worker.parents()}:
                pids |= {child.pid for child in server.children()}
        except (psutil.Error, AttributeError):
            pass
    return pids


@pytest.fixture(scope="module")
def cluster(cluster_settings):
    """The cluster the tests below share (after the two above, which need no cluster or one of their own: a process
    talks to one cluster at a time)."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=head())
    workers = [c.add_node(num_cpus=2, include_dashboard=False) for _ in range(2)]
    c.wait_for_nodes()
    # the tests below share one connection, as a worker's jobs at once do: each node's trial host (its fork server's
    # imports, seconds beside other work) is started once for them all, not once a test
    held = executor_for("ray", c.address)
    yield c, {n.node_id for n in workers}
    held.close()
    ray.shutdown()
    c.shutdown()


def test_a_trial_on_a_ray_node_measures_what_the_same_trial_measures_here(cluster):
    """One rank, then two on one node: the same step-1 loss as the trial run here (the same weights and rows), parity
    ok, and the node each rank ran on named, one of the cluster's worker nodes."""
    c, workers = cluster
    executor = executor_for("ray", c.address)
    try:
        for world in (1, 2):
            spec = TrialSpec(**TRIAL, world_size=world)
            there, here = executor.run(spec), run_trial(spec)
            assert there.status == "ok", there.error
            assert there.loss == pytest.approx(here.loss, rel=1e-5) and there.parity.ok
            assert len(there.nodes) == world and len(set(there.nodes)) == 1
            assert any(node.split("/")[1] == worker[:8] for node in there.nodes for worker in workers), there.nodes
    finally:
        executor.close()


def test_ranks_over_two_nodes_train_bit_for_bit_as_two_ranks_on_one(cluster):
    """Sharded SpeedLoader, 2 nodes x 1 rank against 1 node x 2 ranks (here): the same losses to the bit, each rank
    on its own node, rank 0's node serving the process group's store."""
    c, workers = cluster
    executor = executor_for("ray", c.address)
    try:
        spec = TrialSpec(**{**TRIAL, "steps": 2, "max_steps": 2}, world_size=2)
        there, here = executor.run(spec.model_copy(update={"nodes": 2})), run_trial(spec)
        assert there.status == "ok", there.error
        assert there.loss == here.loss and there.parity.loss == here.parity.loss and there.parity.ok
        assert len(set(there.nodes)) == 2 and {n.split("/")[1] for n in there.nodes} == {w[:8] for w in workers}
        assert [r["rank"] for r in there.ranks] == [0, 1]
    finally:
        executor.close()


@pytest.mark.parametrize("knobs", [pytest.param(dict(backend="deepspeed", zero_stage=3), id="zero3",
                                                marks=needs_deepspeed),
                                   pytest.param(dict(backend="fsdp"), id="fsdp")])
def test_a_wrapped_backend_over_two_nodes_keeps_parity(cluster, knobs):
    c, _ = cluster
    executor = executor_for("ray", c.address)
    try:
        result = executor.run(TrialSpec(**TRIAL, world_size=2, nodes=2, **knobs))
        assert result.status == "ok", result.error
        assert result.parity.ok and len(set(result.nodes)) == 2
    finally:
        executor.close()


def test_more_nodes_than_the_cluster_has_fail_at_once_saying_what_it_has(cluster):
    c, _ = cluster
    executor = executor_for("ray", c.address)
    try:
        start = time.monotonic()
        result = executor.run(TrialSpec(**TRIAL, world_size=3, nodes=3))
        assert result.status == "failed" and time.monotonic() - start < 10
        assert "has 2 nodes with 1 CPUs for hardware.nodes 3 x ranks_per_node 1" in result.error, result.error
    finally:
        executor.close()


def test_profile_runs_its_trial_on_the_cluster_with_executor_ray(cluster):
    import json

    from tests.support.cli import sltune

    c, workers = cluster
    out = sltune("profile", "--executor", "ray", "--nodes", "2", "--ranks-per-node", "1", "--seq-len", "16",
                 "--steps", "1", "--min-time", "0", "--no-profile", "--json", env={"SLTUNE_RAY_ADDRESS": c.address})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["status"] == "ok" and {n.split("/")[1] for n in result["nodes"]} == {w[:8] for w in workers}
    assert result["config"]["world_size"] == 2
    refused = sltune("profile", "--nodes", "2", "--seq-len", "16")
    assert refused.returncode == 2 and "--nodes 2 needs a cluster: add --executor ray" in refused.stderr


def test_executors_in_one_process_share_its_connection_to_the_cluster(cluster):
    """A worker running two jobs at once holds two executors: closing one leaves the other's trials running."""
    c, _ = cluster
    first, second = executor_for("ray", c.address), executor_for("ray", c.address)
    try:
        first.close()
        assert second.run(TrialSpec(**TRIAL)).status == "ok"
    finally:
        first.close()
        second.close()
    assert ray.is_initialized()         # the cluster fixture's connection: the last one closed ends it


def test_a_trial_whose_ranks_fail_answers_their_failure_and_the_node_runs_the_next(cluster):
    """A one-node trial over its device memory limit answers 'oom' as run here does (never an exception), and the
    node's host runs the next trial."""
    c, _ = cluster
    executor = executor_for("ray", c.address)
    try:
        over = TrialSpec(**TRIAL, device_memory_limit=1024)
        there, here = executor.run(over), run_trial(over)
        assert there.status == here.status == "oom", there.error
        assert executor.run(TrialSpec(**TRIAL)).status == "ok"
    finally:
        executor.close()


def test_ranks_no_node_can_hold_fail_at_once_saying_how_many_a_node_has(cluster):
    c, _ = cluster
    executor = executor_for("ray", c.address)
    try:
        start = time.monotonic()
        result = executor.run(TrialSpec(**TRIAL, world_size=3))
        assert result.status == "failed" and time.monotonic() - start < 10
        assert "has 3 CPUs for hardware.world_size 3 (the most a node has: 2 CPUs)" in result.error
    finally:
        executor.close()


def test_a_tuning_job_runs_its_trials_over_the_cluster_s_nodes_and_records_where(cluster, tmp_path):
    """Each trial's two ranks on two nodes (hardware.nodes 2, ranks_per_node 1), every rank's node in the result."""
    c, workers = cluster
    spec = {"name": "on-ray", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 16},
            "hardware": {"executor": "ray", "nodes": 2, "ranks_per_node": 1},
            "search": {"strategy": "grid", "sub_batch_size": [1, 2], "num_sub_batches": [1], "num_live_blocks": [1],
                       "trial_steps": 1, "trial_min_time_s": 0.1, "confirm_rounds": 0}}
    result = tune(spec, f"sqlite:///{tmp_path / 'jobs.db'}",
                  settings=Settings(data_dir=tmp_path / "data", ray_address=c.address))
    assert result["status"] == "succeeded", result["error"]
    assert [t["status"] for t in result["trials"]] == ["ok", "ok"]
    for t in result["trials"]:
        assert {n.split("/")[1] for n in t["nodes"]} == {w[:8] for w in workers}, t["nodes"]


def test_a_grid_job_s_trials_run_two_at_once_on_both_nodes_as_a_local_job_runs_them(cluster, tmp_path):
    """hardware.parallel_trials 2: the same configs, in the same order, with the same statuses as the job run here one
    trial at a time; its search trials over both nodes, two of them running at once; its confirmation round on one."""
    c, workers = cluster
    search = {"strategy": "grid", "sub_batch_size": [1, 2], "num_sub_batches": [1, 2], "num_live_blocks": [1],
              "trial_steps": 1, "trial_min_time_s": 0.1, "confirm_rounds": 1}
    spec = {"name": "side-by-side", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 16}, "search": search}
    here = tune(spec, f"sqlite:///{tmp_path / 'here.db'}", settings=Settings(data_dir=tmp_path / "here"))
    db = f"sqlite:///{tmp_path / 'there.db'}"
    there = tune({**spec, "hardware": {"executor": "ray", "parallel_trials": 2}}, db,
                 settings=Settings(data_dir=tmp_path / "there", ray_address=c.address))
    assert there["status"] == "succeeded", there["error"]
    search_trials = [t for t in there["trials"] if t["role"] != "confirm"]
    assert [(t["config"], t["status"]) for t in search_trials] == \
        [(t["config"], t["status"]) for t in here["trials"] if t["role"] != "confirm"]
    assert {t["nodes"][0].split("/")[1] for t in search_trials} == {w[:8] for w in workers}
    rows = sorted((t for t in Store(db).trials(there["job_id"]) if t.role != "confirm"), key=lambda t: t.number)
    assert any(a.finished_at > b.started_at for a, b in zip(rows, rows[1:])), \
        [(t.number, t.started_at, t.finished_at) for t in rows]
    confirms = [t for t in there["trials"] if t["role"] == "confirm"]
    assert len(confirms) >= 2 and len({t["nodes"][0] for t in confirms}) == 1, confirms


def test_parallel_trials_beyond_the_cluster_s_nodes_run_as_many_as_it_holds(cluster, tmp_path):
    """Four trials at once asked of two nodes: two at once, the job's progress saying so, and every trial runs."""
    c, _ = cluster
    spec = {"name": "too-wide", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 16},
            "hardware": {"executor": "ray", "parallel_trials": 4},
            "search": {"strategy": "grid", "sub_batch_size": [1, 2], "num_sub_batches": [1, 2], "num_live_blocks": [1],
                       "trial_steps": 1, "trial_min_time_s": 0.1, "confirm_rounds": 0}}
    notes = []
    result = tune(spec, f"sqlite:///{tmp_path / 'jobs.db'}", progress=lambda p: notes.append(p.get("note")),
                  settings=Settings(data_dir=tmp_path / "data", ray_address=c.address))
    assert [t["status"] for t in result["trials"]] == ["ok"] * 4, result["trials"]
    assert any(n and "hold 2 such trials at once" in n for n in notes), notes


def test_a_node_that_cannot_run_the_trial_is_refused_at_pre_flight_naming_it_and_the_fix(cluster, tmp_path):
    """A third node joins, started apart (`ray start` in a mount namespace of its own, as on another machine): first
    where an empty folder is mounted over the model's, then with another torch on its path. A trial over all three
    nodes is refused before any rank starts, in one line naming that node and the fix; the same trial over the two
    nodes that have both runs."""
    import shutil
    import subprocess
    import sys
    from importlib.metadata import version

    from sltune.models import PRESETS

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding a folder from one node needs a mount namespace of its own: root and unshare")
    c, workers = cluster
    models = tmp_path / "models"
    PRESETS["llama-tiny"].config().save_pretrained(models / "tiny")
    other = tmp_path / "other" / "torch-9.9.9.dist-info"
    other.mkdir(parents=True)
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    spec = TrialSpec(**{**TRIAL, "model": str(models / "tiny")}, world_size=3, nodes=3)
    executor = executor_for("ray", c.address)
    try:
        for setup, env, refusal in [(f"mount -t tmpfs none {models}", {}, "cannot read the model at "
                                     f"{models / 'tiny'} (no such file or folder): every node needs the model at the "
                                     "same path"),
                                    ("true", {"PYTHONPATH": str(other.parent)},
                                     f"has torch 9.9.9 where this machine has {version('torch')}: install the same")]:
            ray_cli = Path(sys.executable).with_name("ray")
            node = subprocess.Popen(["unshare", "-m", "sh", "-c", f"{setup} && exec {ray_cli} start --address "
                                     f"{c.address} --num-cpus 1 --block"],
                                    env={**os.environ, **env}, start_new_session=True, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 120
                while sum(n["Alive"] and n["Resources"].get("CPU", 0) > 0 for n in ray.nodes()) < 3:
                    assert time.monotonic() < deadline and node.poll() is None, "the third node did not join"
                    time.sleep(0.5)
                started = time.monotonic()
                refused = executor.run(spec)
                assert refused.status == "failed" and refused.error.startswith("pre-flight: Ray node "), refused.error
                assert refusal in refused.error and "\n" not in refused.error, refused.error
                assert time.monotonic() - started < 60
            finally:
                os.killpg(node.pid, 9)
                node.wait()
            deadline = time.monotonic() + 60
            while sum(n["Alive"] and n["Resources"].get("CPU", 0) > 0 for n in ray.nodes()) > 2:
                assert time.monotonic() < deadline, "the third node is still alive"
                time.sleep(0.5)
        ran = executor.run(spec.model_copy(update={"world_size": 2, "nodes": 2}))
        assert ran.status == "ok", ran.error
    finally:
        executor.close()
