"""kill -9 of a worker, or of `sltune serve` with its embedded worker, leaves none of its process tree
running: trials, fork servers, the embedded worker and the API processes of `serve --workers 2` all follow
within seconds, and the job is taken over by another worker as before."""

import os
import signal
import time

import httpx
import psutil

from tests.conftest import tiny_spec

LONG = dict(trials=1, trial_steps=1000, trial_timeout_s=120)      # a trial that runs for many seconds


def _running_trial(c, job_id: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(t["status"] == "running" for t in c.get(f"/jobs/{job_id}/trials").json()):
            time.sleep(0.5)              # the trial process is past its start
            return
        time.sleep(0.2)
    raise AssertionError(f"no trial of job {job_id} started")


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


def test_kill_9_of_a_worker_or_of_serve_leaves_none_of_its_tree_and_the_job_is_taken_over(services):
    services.serve()
    worker = services.worker()
    with services.client() as c:
        job_id = c.post("/tune", json=tiny_spec("long", **LONG)).json()["job_id"]
        _running_trial(c, job_id)
        # a second server, two API processes and its embedded worker waiting to take over
        c2 = httpx.Client(base_url=services.serve(worker=True, workers=2), timeout=30)
        server = services.procs[-1]

        tree, alive = _kill_and_count_survivors(worker.p.pid)
        assert any("forkserver" in cmd for cmd in tree) and alive == [], alive

        job = c.get(f"/jobs/{job_id}").json()
        deadline = time.monotonic() + 60
        while not (job["attempts"] == 2 and job["status"] == "running") and time.monotonic() < deadline:
            time.sleep(0.2)
            job = c.get(f"/jobs/{job_id}").json()
        assert job["attempts"] == 2 and job["status"] == "running", job      # taken over as before
        _running_trial(c2, job_id)
        tree, alive = _kill_and_count_survivors(server.p.pid)
        assert any(" worker " in cmd for cmd in tree) and any("forkserver" in cmd for cmd in tree), tree
        assert sum("spawn_main" in cmd for cmd in tree) >= 2, tree          # the two API processes
        assert alive == [], (alive, server.output()[-3000:])
