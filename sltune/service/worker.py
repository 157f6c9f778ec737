"""A worker: claims queued jobs it can run, holds them with a heartbeat, runs them, lets go.

Workers are processes of their own (never the API's event loop); any number of them on any machine that
reaches the database. A job is claimed atomically (see Store.claim) and held by a lease the heartbeat
renews; if the worker dies the lease runs out and another worker takes the job over, continuing from
the trials already stored. Cancelling a job is noticed within half a second, even mid-trial.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import psutil

from sltune.service.capabilities import can_run, local_capabilities, why_not
from sltune.settings import Settings
from sltune.store import Store
from sltune.store.faults import describe, is_transient
from sltune.tuning.runner import StopReason, run_job

log = logging.getLogger("sltune.worker")
UNRUNNABLE_AFTER_S = 60.0   # a queued job no live worker can run fails after this long, saying why


class Worker:
    def __init__(self, settings: Settings, worker_id: str | None = None, capabilities: dict[str, Any] | None = None):
        self.settings = settings
        # every store call rides out a database restart or a full disk for settings.store_retry_s; the cancel
        # check polled while a trial runs does not wait (a failed look is "not cancelled")
        self.store = Store(settings.db_url(), retry_s=settings.store_retry_s)
        self.quick = Store(settings.db_url())
        self.id = worker_id or self.default_id()
        self.caps = capabilities or local_capabilities(settings.ray_address)
        self.stop = threading.Event()

    @staticmethod
    def default_id() -> str:
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"

    @staticmethod
    def is_dead_here(worker_id: str | None) -> bool:
        """A holder id naming this host and a process that no longer exists: its lease is moot."""
        if not worker_id:
            return False
        parts = worker_id.removeprefix("cli:").split(":")
        if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
            return False
        return not psutil.pid_exists(int(parts[1]))

    def run_forever(self) -> None:
        """Claim and run jobs until stopped: settings.jobs_per_worker at a time (default 1, since trials
        running side by side on the same cores disturb each other's throughput figures)."""
        # no model code runs here: the cost model's shapes and traces run in children of the fork server, which
        # has transformers' model code loaded (sltune.profiling.forks.call), and so do the trials
        self.store.register_worker(self.id, self.caps)
        log.info("worker %s ready (%s), %d job(s) at a time", self.id, self.caps, self.settings.jobs_per_worker)
        extra = [threading.Thread(target=self._loop, name=f"jobs-{i}", daemon=True)
                 for i in range(1, self.settings.jobs_per_worker)]
        for t in extra:
            t.start()
        try:
            self._loop()
        finally:
            self.stop.set()
            for t in extra:
                t.join()
            try:
                self.store.remove_worker(self.id)
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("worker %s could not deregister", self.id)

    def _loop(self) -> None:
        backoff = self.settings.poll_seconds
        while not self.stop.is_set():
            try:
                # touched at every turn: a worker running short jobs back to back (none outlasting a heartbeat)
                # must not look dead to /healthz and waiting_for
                self.store.touch_worker(self.id)
                job = self.store.claim(self.id, lambda req: can_run(self.caps, req), self.settings.lease_seconds)
                if job is None:
                    self.store.prune_workers(self.settings.forget_workers_after_s)
                    self._fail_unrunnable()
                    self.stop.wait(self.settings.poll_seconds)
                    continue
                backoff = self.settings.poll_seconds
            except Exception as err:  # noqa: BLE001 - a database hiccup must not end the worker
                if is_transient(err):
                    log.warning("worker %s: the store is unreachable or full (%s); retrying in %.1fs", self.id,
                                describe(err), backoff)
                else:
                    log.exception("worker %s: the store failed; retrying in %.1fs", self.id, backoff)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            self.run(job.id)

    def run(self, job_id: str, progress=None, reraise: bool = False) -> dict[str, Any] | None:
        """Run a job this worker holds (claimed), renewing its lease until it is done or let go."""
        lost = threading.Event()
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(self.settings.heartbeat_seconds):
                try:
                    if not self.store.heartbeat(job_id, self.id, self.settings.lease_seconds):
                        lost.set()
                        return
                    self.store.touch_worker(self.id)
                except Exception as err:  # noqa: BLE001 - a failed heartbeat is retried; the lease has slack
                    if is_transient(err):
                        log.warning("heartbeat for job %s failed (%s)", job_id, describe(err))
                    else:
                        log.exception("heartbeat for job %s failed", job_id)

        def should_stop() -> StopReason | None:
            if self.stop.is_set():
                return StopReason("released", "released: the worker is shutting down")
            if lost.is_set():
                return StopReason("released", "released: this worker lost its lease on the job")
            try:
                if self.quick.cancel_requested(job_id):
                    return StopReason("cancelled", "cancelled by request")
            except Exception as err:  # noqa: BLE001 - the database is away; the trial goes on meanwhile
                log.warning("job %s: cannot check for a cancel request (%s)", job_id, describe(err))
            return None

        beat = threading.Thread(target=heartbeat, name=f"heartbeat-{job_id}", daemon=True)
        beat.start()
        log.info("worker %s runs job %s", self.id, job_id)
        result = None
        try:
            result = run_job(self.store, job_id, progress=progress, should_stop=should_stop, worker_id=self.id,
                             artifact_dir=self.settings.artifact_dir(), offload_root=self.settings.offload_root(),
                             default_host_limit=self.settings.trial_host_limit(),
                             max_trial_steps=self.settings.max_trial_steps, max_trials=self.settings.max_trials,
                             ray_address=self.settings.ray_address)
            log.info("job %s %s", job_id, result["status"])
        except Exception as err:  # noqa: BLE001 - the job fails with the reason; the worker goes on
            if is_transient(err):
                # the database stayed away (or the disk full) past the retries: not the job's fault. It stays
                # running under this worker's lease; when that runs out a worker (this one, say) resumes it
                # from its stored trials
                log.error("job %s: the store failed for over %.0fs (%s); the job is left to be resumed",
                          job_id, self.settings.store_retry_s, describe(err))
            else:
                log.exception("job %s failed", job_id)
                try:
                    self.store.set_status(job_id, "failed", holder=self.id, error=f"{type(err).__name__}: {err}")
                except Exception as again:  # noqa: BLE001 - the worker goes on; the lease hands the job on
                    log.error("job %s: cannot record its failure (%s)", job_id, describe(again))
            if reraise:
                raise
        finally:
            done.set()
            beat.join()
            if self.stop.is_set() and not lost.is_set():
                try:
                    job = self.store.job(job_id)
                    if job is not None and job.status == "running" and job.worker_id == self.id:
                        # shutting down mid-job: hand it back now rather than when the lease runs out
                        self.store.set_status(job_id, "queued", holder=self.id, worker_id=None,
                                              lease_expires_at=None)
                except Exception as err:  # noqa: BLE001 - the lease hands it on instead
                    log.error("job %s: cannot hand it back (%s); its lease will", job_id, describe(err))
        return result

    def _fail_unrunnable(self) -> None:
        """Queued jobs that no live worker can run fail with the reason instead of waiting forever."""
        live = self.store.live_workers(within_s=self.settings.alive_within_s)
        if not live:
            return
        for job in self.store.jobs(limit=50, status="queued"):
            age = time.time() - job.created_at.timestamp()       # created_at is UTC (UTCDateTime)
            if age < UNRUNNABLE_AFTER_S or any(can_run(w.capabilities, job.requirements) for w in live):
                continue
            reasons = sorted({why_not(w.capabilities, job.requirements) or "" for w in live})
            self.store.fail_if_queued(job.id, f"no live worker can run this job: {'; '.join(reasons)}")
