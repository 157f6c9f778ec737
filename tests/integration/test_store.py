"""The store behaves the same on SQLite and PostgreSQL: claims are atomic, leases expire, cancels land."""

import threading
import time
from datetime import timedelta

import pytest

from sltune.store import Store
from sltune.store.db import engine_for
from tests.support.specs import tiny_spec

SPEC = tiny_spec()
REQ = {"device": "cpu", "device_memory_limit": None, "world_size": 1}


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    yield Store(url)
    engine_for.cache_clear()


def make_jobs(store, n):
    return [store.create_job(f"j{i}", SPEC, f"hash{i}", REQ).id for i in range(n)]


def test_concurrent_claims_never_share_a_job(store):
    ids = make_jobs(store, 12)
    claimed: list[str] = []
    lock = threading.Lock()

    def worker(name):
        while True:
            job = store.claim(name, lambda req: True, lease_s=60)
            if job is None:
                return
            with lock:
                claimed.append(job.id)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == sorted(ids)          # every job once, none twice


def test_an_expired_lease_is_taken_over_and_the_old_holder_is_fenced_out(store):
    (job_id,) = make_jobs(store, 1)
    assert store.claim("a", lambda r: True, lease_s=0.5).id == job_id
    assert store.claim("b", lambda r: True, lease_s=60) is None          # held
    assert not store.claim_job(job_id, "cli", 60)                         # held, also for a CLI run
    time.sleep(0.8)
    taken = store.claim("b", lambda r: True, lease_s=60)
    assert taken.id == job_id and taken.worker_id == "b" and taken.attempts == 2
    assert store.heartbeat(job_id, "a", 60) is False
    assert store.heartbeat(job_id, "b", 60) is True
    # the old holder writes nothing more: no trial, no progress, no status
    assert not store.start_trial(job_id, 0, "probe", {}, {}, 0, "a")
    assert not store.update_progress(job_id, {"phase": "stale"}, holder="a")
    assert not store.set_status(job_id, "failed", holder="a")
    job = store.job(job_id)
    assert job.status == "running" and job.progress.get("phase") != "stale"
    assert job.created_at.tzinfo is not None                              # UTC on every database


def test_claims_respect_what_a_worker_can_run(store):
    store.create_job("gpu", SPEC, "h", {**REQ, "device": "cuda"})
    assert store.claim("cpu-only", lambda req: req["device"] == "cpu", 60) is None


def test_cancel_queued_now_running_by_request(store):
    a, b = make_jobs(store, 2)
    store.claim("w", lambda r: True, 60)              # a is running now
    assert store.request_cancel(b).status == "cancelled"
    assert store.request_cancel(a).status == "running" and store.cancel_requested(a)


def test_trials_fits_and_artifacts_round_trip(store):
    (job_id,) = make_jobs(store, 1)
    assert not store.start_trial(job_id, 0, "probe", {}, {}, 0, "w")      # fenced: "w" does not hold the job
    assert store.claim("w", lambda r: True, 60).id == job_id
    assert store.start_trial(job_id, 0, "probe", {"sub_batch_size": 1}, {"fits": True}, 0, "w")
    assert store.interrupt_running_trials(job_id) == 1
    store.start_trial(job_id, 1, "probe", {"sub_batch_size": 2}, {}, 1, "w")
    assert not store.finish_trial(job_id, 1, {"status": "ok"}, worker_id="other")   # fenced
    assert store.finish_trial(job_id, 1, {"status": "ok", "tokens_per_s": 10.0, "peak_device_bytes": 5}, worker_id="w")
    assert [(t.number, t.status) for t in store.trials(job_id)] == [(0, "interrupted"), (1, "ok")]
    store.save_fit(job_id, "device", 1, {"coef": [1.0]})
    store.add_artifact(job_id, 1, "trace", "x/trial-1.json", 10)
    assert store.fits(job_id)[0].payload == {"coef": [1.0]}
    assert store.artifact(job_id, 1, "trace").path == "x/trial-1.json"


def test_rows_of_silent_workers_are_pruned(store):
    from sltune.store.schema import Worker, now

    store.register_worker("alive", {})
    store.register_worker("dead", {})
    with store.Session.begin() as s:
        s.get(Worker, "dead").last_seen = now() - timedelta(seconds=700)
    assert store.prune_workers(600) == 1
    assert [w.id for w in store.live_workers(within_s=3600)] == ["alive"]


def test_the_list_view_reads_only_the_best_of_a_result(store):
    job = store.create_job("j", SPEC, "h", REQ)
    best = {"tokens_per_s": 12.5, "config": {"sub_batch_size": 2}}
    store.set_status(job.id, "succeeded", result={"best": best, "trials": [{"number": 0}] * 50})
    row = store.job_summaries(limit=10)[0]
    assert row["id"] == job.id and row["best"] == best and "trials" not in row and "spec" not in row
    assert store.job_summaries(limit=10, status="queued") == []
