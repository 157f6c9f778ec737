"""Two `sltune worker` processes behind a real server on PostgreSQL run six jobs, each exactly once."""

from sltune.store import Store
from tests.support.specs import tiny_spec


def test_two_workers_on_postgres_run_six_jobs_each_exactly_once(pg_url, tmp_path):
    from tests.support.servers import Services, wait_for

    svc = Services(tmp_path, pg_url)
    try:
        svc.serve()
        svc.worker()
        svc.worker()
        with svc.client() as c:
            ids = [c.post("/tune", json=tiny_spec(f"pg{i}", trials=2)).json()["job_id"] for i in range(6)]
            jobs = [wait_for(c, j, timeout=400) for j in ids]
            assert all(j["status"] == "succeeded" for j in jobs), jobs
            assert all(j["attempts"] == 1 for j in jobs)             # claimed once each
            for j in ids:
                trials = c.get(f"/jobs/{j}/trials").json()
                assert len(trials) == 2 and len({str(t["config"]) for t in trials}) == 2
                assert all(t["status"] in ("ok", "oom") for t in trials)
        store = Store(pg_url)
        holders = {store.job(j).worker_id for j in ids}
        assert len(holders) == 2, holders                         # both workers took jobs
    finally:
        svc.stop()
