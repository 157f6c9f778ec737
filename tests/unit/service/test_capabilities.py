"""Which jobs a worker claims: a job whose trials run on a Ray cluster (hardware.executor ray) is claimed by a worker
started with Ray and a cluster's address, whatever its own devices and cores; a local job by a worker that holds
its ranks and devices."""

from sltune.service.capabilities import local_capabilities, why_not
from sltune.tuning.runner import requirements
from tests.support.specs import admitted_spec


def test_a_ray_job_needs_a_worker_with_a_cluster_and_not_the_worker_s_cores(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_job = requirements(admitted_spec({"name": "r", "model": {"preset": "llama-tiny"},
                                          "hardware": {"executor": "ray", "nodes": 4, "ranks_per_node": 8}}))
    assert ray_job["executor"] == "ray" and ray_job["world_size"] == 32
    with_cluster = local_capabilities("127.0.0.1:6380")
    without = local_capabilities(None)
    assert with_cluster["executors"] == ["local", "ray"] and why_not(with_cluster, ray_job) is None
    assert without["executors"] == ["local"]
    assert "needs a ray cluster (hardware.executor)" in why_not(without, ray_job)
    local_job = requirements(admitted_spec({"name": "l", "model": {"preset": "llama-tiny"},
                                            "hardware": {"world_size": 1}}))
    assert "executor" not in local_job and why_not(without, local_job) is None
    assert "runs at most" in why_not(without, {**local_job, "world_size": without["max_world_size"] + 1})
