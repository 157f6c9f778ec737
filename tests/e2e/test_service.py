"""The tuning service as CI meets it: a real uvicorn server on loopback, real workers, a real database."""

import json
import time

import pytest
import yaml

from sltune import SpeedLoaderConfig
from tests.support.cli import sltune
from tests.support.servers import Services, wait_for
from tests.support.specs import tiny_spec


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server with its embedded worker (two jobs at a time) for the tests that only use it: starting one
    costs 20-30 s of imports on a busy 2-core machine. The tests that kill or restart processes start their own."""
    tmp = tmp_path_factory.mktemp("shared")
    svc = Services(tmp, f"sqlite:///{tmp / 'jobs.db'}")
    svc.env["SLTUNE_JOBS_PER_WORKER"] = "2"
    svc.serve(worker=True)
    yield svc
    svc.stop()


def test_post_tune_poll_and_fetch_the_config_as_ci_would(shared, tmp_path):
    services = shared
    with services.client() as c:
        r = c.post("/tune", json=tiny_spec("ci", trials=3, profile=True))
        assert r.status_code == 202 and r.json()["status"] == "queued"
        job_id = r.json()["job_id"]
        job = wait_for(c, job_id)
        assert job["status"] == "succeeded", job
        assert job["best"]["tokens_per_s"] > 0 and job["models"]["device"]["n"] >= 1
        text = c.get(f"/jobs/{job_id}/config.yaml").text
        path = tmp_path / "best.yaml"
        path.write_text(text)
        cfg = SpeedLoaderConfig.from_yaml(path)
        assert cfg.sub_batch_size == job["best"]["config"]["sub_batch_size"]
        trials = c.get(f"/jobs/{job_id}/trials").json()
        assert len(trials) == 3 and all(t["result"]["status"] in ("ok", "oom") for t in trials)
        ok = next(t for t in trials if t["status"] == "ok")
        trace = c.get(ok["trace_url"])
        assert trace.status_code == 200 and "traceEvents" in trace.json()
        assert any(j["id"] == job_id for j in c.get("/jobs").json())
        assert c.get("/openapi.json").json()["paths"]["/tune"]["post"]


def test_writes_need_the_token_and_bad_specs_get_field_errors(shared):
    services = shared
    with services.client(token=None) as anon, services.client(token="wrong") as wrong, services.client() as c:
        assert anon.post("/tune", json=tiny_spec()).status_code == 401
        assert wrong.post("/tune", json=tiny_spec()).status_code == 401
        assert anon.get("/jobs").status_code == 200            # reads stay open
        r = c.post("/tune", json={**tiny_spec(), "search": {"max_trials": 0, "sub_batch_size": {"min": 4, "max": 1}}})
        assert r.status_code == 422
        locs = {".".join(str(p) for p in e["loc"]) for e in r.json()["detail"]}
        assert "body.search.max_trials" in locs and "body.search.sub_batch_size" in locs
        r = c.post("/tune", json={**tiny_spec(), "hardware": {"device_memory_limit": "1KiB"}})
        assert r.status_code == 422 and "smallest config" in r.text
        r = c.post("/tune", json={**tiny_spec(), "model": {"hf_config": {"model_type": "llama",
                                                                          "auto_map": {"x": "y"}}}})
        assert r.status_code == 422 and "can load code" in r.text
        r = c.post("/tune", json=tiny_spec(trials=10_000))
        assert r.status_code == 422 and "above this server's limit" in r.text
        r = c.post("/tune", content=b"x" * 300_000, headers={"content-type": "application/json"})
        assert r.status_code == 413
        chunks = (b"x" * 10_000 for _ in range(100))                  # chunked: no Content-Length
        r = c.post("/tune", content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413
        chunks = (b"x" * 10_000 for _ in range(100))                  # without the token: never read
        assert anon.post("/tune", content=chunks, headers={"content-type": "application/json"}).status_code == 401
        assert c.get("/jobs/nope").status_code == 404
        assert anon.post("/jobs/nope/cancel").status_code == 401


def test_cancel_stops_a_running_job_promptly(services):
    services.serve()
    worker = services.worker()
    with services.client() as c:
        job_id = c.post("/tune", json=tiny_spec("long", trials=50, sub_batch_size=[1], num_sub_batches=[1],
                                                num_live_blocks=[1], trial_steps=1000)).json()["job_id"]
        wait_for(c, job_id, statuses=("running",))
        time.sleep(2)     # a trial is under way
        t0 = time.monotonic()
        assert c.post(f"/jobs/{job_id}/cancel").status_code == 200
        job = wait_for(c, job_id, timeout=30)
        assert job["status"] == "cancelled" and time.monotonic() - t0 < 10
        worker.kill()                    # no worker any more: a new job stays queued ...
        queued = c.post("/tune", json=tiny_spec("never")).json()["job_id"]
        assert c.get(f"/jobs/{queued}").json()["status"] == "queued"
        assert c.post(f"/jobs/{queued}/cancel").json()["status"] == "cancelled"   # ... and cancels at once


def test_killed_worker_job_is_taken_over_without_losing_or_repeating_trials(services):
    services.serve()
    first = services.worker()
    with services.client() as c:
        job_id = c.post("/tune", json=tiny_spec("takeover", trials=8, strategy="grid", sub_batch_size=[1, 2],
                                                num_sub_batches=[1, 2], num_live_blocks=[1, 2],
                                                trial_steps=3)).json()["job_id"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            trials = c.get(f"/jobs/{job_id}/trials").json()
            if sum(t["status"] == "ok" for t in trials) >= 2 and any(t["status"] == "running" for t in trials):
                break
            time.sleep(0.2)
        first.kill()                                   # kill -9, trial child and all
        before = {t["number"]: t for t in c.get(f"/jobs/{job_id}/trials").json() if t["status"] == "ok"}
        assert len(before) >= 2
        services.worker()
        job = wait_for(c, job_id)
        assert job["status"] == "succeeded" and job["attempts"] == 2
        after = c.get(f"/jobs/{job_id}/trials").json()
        for number, t in before.items():
            assert next(a for a in after if a["number"] == number)["result"] == t["result"]
        done = [json.dumps(t["config"], sort_keys=True) for t in after if t["status"] != "interrupted"]
        assert len(done) == len(set(done)) == 8                     # every config once, none lost
        assert any(t["status"] == "interrupted" for t in after)    # the one killed mid-way, run again


def test_a_job_no_worker_can_run_says_so(shared):
    services = shared
    with services.client() as c:
        spec = tiny_spec("gpu")
        spec["hardware"]["device"] = "cuda"
        job_id = c.post("/tune", json=spec).json()["job_id"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            job = c.get(f"/jobs/{job_id}").json()
            if job["waiting_for"] and "can run" in job["waiting_for"]:
                break
            time.sleep(0.3)
        assert job["status"] == "queued" and "needs device 'cuda'" in job["waiting_for"]


def test_submit_and_compare_cli(shared, tmp_path):
    services = shared
    url = services.url
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec("cli", trials=2)))
    env = {"SLTUNE_API_TOKEN": services.env["SLTUNE_API_TOKEN"]}
    out = tmp_path / "best.yaml"
    r = sltune("submit", str(spec), "--server", url, "--wait", "--out", str(out), env=env)
    assert r.returncode == 0, r.stderr
    job_a = r.stdout.strip()
    assert SpeedLoaderConfig.from_yaml(out).sub_batch_size >= 1
    same = sltune("compare", job_a, job_a, "--server", url, "--json", env=env)
    assert same.returncode == 0 and json.loads(same.stdout)["change"] == 0.0
    bad = sltune("submit", str(spec), "--server", url, env={"SLTUNE_API_TOKEN": "nope"})
    assert bad.returncode == 2 and "401" in bad.stderr


def test_compare_gate_flags_a_regression():
    from sltune.tuning.report.compare import JobData, compare

    def job(tps):
        return JobData("j", "succeeded", {}, None, [
            {"status": "ok", "config": {"sub_batch_size": b, "num_sub_batches": 1, "num_live_blocks": 1},
             "result": {"tokens_per_s": t}} for b, t in tps.items()])

    r = compare(job({1: 100.0, 2: 200.0}), job({1: 100.0, 2: 180.0}))
    assert r["change"] == pytest.approx(-0.10) and r["verdict"] == "regression"
    assert [row["ratio"] for row in r["rows"]] == [pytest.approx(1.0), pytest.approx(0.9)]


def test_a_worker_runs_as_many_jobs_at_once_as_configured(shared):
    services = shared                  # its embedded worker takes two jobs at a time
    with services.client() as c:
        ids = [c.post("/tune", json=tiny_spec(f"par{i}", trials=3, trial_steps=20)).json()["job_id"]
               for i in range(2)]
        both = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not both:
            both = all(c.get(f"/jobs/{j}").json()["status"] == "running" for j in ids)
            time.sleep(0.2)
        assert both, "the two jobs never ran at the same time"
        assert {c.get(f"/jobs/{j}").json()["worker_id"] for j in ids} == {c.get(f"/jobs/{ids[0]}").json()["worker_id"]}
        for j in ids:
            assert wait_for(c, j)["status"] == "succeeded"
