"""Trials on a real Ray cluster (sltune.executors, hardware.executor ray): a local cluster of simulated nodes
(ray.cluster_utils.Cluster: a head that runs nothing and two worker nodes of 2 CPUs each, on this machine), real
trials on them, a real tuning job whose trials run there. Ray is the optional extra `ray` (the test install has it)."""

from __future__ import annotations

import time

import pytest

from sltune.executors import executor_for
from sltune.loopback import free_port
from sltune.profiling import run_trial
from sltune.profiling.schema import TrialSpec
from sltune.service.local import tune
from sltune.settings import Settings

ray = pytest.importorskip("ray", reason="Ray is the optional extra ray: pip install -e '.[ray]' (scripts/install.sh "
                                        "test installs it)")


def head() -> dict:
    """A head that runs no task (trials land on worker nodes), on a port of its own (6379, Ray's default, is Redis's
    on this machine)."""
    return {"num_cpus": 0, "include_dashboard": False, "gcs_server_port": free_port()}


TRIAL = dict(model="llama-tiny", seq_len=16, steps=1, min_time_s=0.0, max_steps=1, remeasure=0, profile=False)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=head())
    workers = [c.add_node(num_cpus=2, include_dashboard=False) for _ in range(2)]
    c.wait_for_nodes()
    yield c, {n.node_id for n in workers}
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


def test_profile_runs_its_trial_on_the_cluster_with_executor_ray(cluster):
    import json

    from tests.support.cli import sltune

    c, workers = cluster
    out = sltune("profile", "--executor", "ray", "--seq-len", "16", "--steps", "1", "--min-time", "0", "--no-profile",
                 "--json", env={"SLTUNE_RAY_ADDRESS": c.address})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["status"] == "ok" and any(result["nodes"][0].endswith(f"/{w[:8]}") for w in workers)


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


def test_a_tuning_job_runs_its_trials_on_the_cluster_and_records_where(cluster, tmp_path):
    c, workers = cluster
    spec = {"name": "on-ray", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 16},
            "hardware": {"executor": "ray"},
            "search": {"strategy": "grid", "sub_batch_size": [1, 2], "num_sub_batches": [1], "num_live_blocks": [1],
                       "trial_steps": 1, "trial_min_time_s": 0.1, "confirm_rounds": 0}}
    result = tune(spec, f"sqlite:///{tmp_path / 'jobs.db'}",
                  settings=Settings(data_dir=tmp_path / "data", ray_address=c.address))
    assert result["status"] == "succeeded", result["error"]
    assert [t["status"] for t in result["trials"]] == ["ok", "ok"]
    for t in result["trials"]:
        assert any(t["nodes"][0].endswith(f"/{w[:8]}") for w in workers), t["nodes"]


def test_a_node_that_dies_under_a_trial_fails_that_trial_in_one_line(tmp_path):
    """A cluster of its own, one worker node: its raylet removed while the trial runs (a trial timed for 60 s). The
    trial fails within seconds naming what Ray reported, and the executor runs the next trial on a node that lives."""
    import threading

    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=head())
    doomed = c.add_node(num_cpus=2, include_dashboard=False)
    c.wait_for_nodes()
    executor = executor_for("ray", c.address)
    try:
        out = {}
        runs = threading.Thread(target=lambda: out.update(result=executor.run(
            TrialSpec(**{**TRIAL, "steps": 1000, "max_steps": 1000, "min_time_s": 60.0}))))
        runs.start()
        time.sleep(8)                   # the trial's fork server is up and its steps are running
        killed = time.monotonic()
        c.remove_node(doomed, allow_graceful=False)
        runs.join(60)
        assert not runs.is_alive() and time.monotonic() - killed < 45
        result = out["result"]
        assert result.status == "failed" and "the Ray node running the trial failed" in result.error, result
        assert "\n" not in result.error
        c.add_node(num_cpus=2, include_dashboard=False)
        c.wait_for_nodes()
        assert executor.run(TrialSpec(**TRIAL)).status == "ok"
    finally:
        executor.close()
        c.shutdown()


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
