"""kill -9 of `sltune serve` (two API processes and its embedded worker), or of a worker, leaves none of its
process tree running: trials, fork servers, the embedded worker and the API processes all follow within
seconds, and the job is taken over by another worker as before."""

import os
import signal
import time

import psutil

from sltune.store import Store
from tests.support.specs import tiny_spec

LONG = dict(trials=1, trial_steps=1000, trial_timeout_s=120)      # a trial that runs for many seconds


def long_spec() -> dict:
    """A job whose trial runs for many seconds on one core: the other is left to start the next worker."""
    spec = tiny_spec("long", **LONG)
    spec["hardware"]["cpu_threads"] = 1
    return spec


def _running_trial(store: Store, job_id: str, attempt: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = store.job(job_id)
        if job.attempts == attempt and any(t.status == "running" for t in store.trials(job_id)):
            time.sleep(0.5)              # the trial process is past its start
            return
        time.sleep(0.2)
    raise AssertionError(f"no trial of job {job_id} started in attempt {attempt}: {store.job(job_id)}")


def _kill_and_count_survivors(pid: int, within_s: float = 10) -> tuple[list[str], list[str]]:
    """kill -9 `pid`; its descendants' command lines, and those of any still alive `within_s` later."""
    tree = {p: " ".join(p.cmdline()) for p in psutil.Process(pid).children(recursive=True)}
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + within_s
    while True:
        alive = [cmd for p, cmd in tree.items() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return list(tree.values()), alive
        time.sleep(0.2)


def test_kill_9_of_serve_or_of_a_worker_leaves_none_of_its_tree_and_the_job_is_taken_over(services):
    services.serve(worker=True, workers=2)
    server = services.procs[-1]
    store = Store(services.db)
    with services.client() as c:
        job_id = c.post("/tune", json=long_spec()).json()["job_id"]
    _running_trial(store, job_id, attempt=1)                      # on serve's embedded worker
    worker = services.worker()                                  # waiting to take over

    tree, alive = _kill_and_count_survivors(server.p.pid)
    assert any(" worker " in cmd for cmd in tree) and any("forkserver" in cmd for cmd in tree), tree
    assert sum("spawn_main" in cmd for cmd in tree) >= 2, tree          # the two API processes
    assert alive == [], (alive, server.output()[-3000:])

    _running_trial(store, job_id, attempt=2)                      # taken over as before
    assert store.job(job_id).status == "running"
    tree, alive = _kill_and_count_survivors(worker.p.pid)
    assert any("forkserver" in cmd for cmd in tree) and alive == [], alive
