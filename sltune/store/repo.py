"""Operations on the store, each one short transaction; the tuner and the service share them."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update

from sltune.store.db import is_postgres, sessions
from sltune.store.faults import durable
from sltune.store.schema import Artifact, Calibration, Fit, Job, Trial, Worker, now

ACTIVE = ("queued", "running")
FINISHED = ("succeeded", "failed", "cancelled")


@durable
class Store:
    """A handle on one database (SQLite file or PostgreSQL), by URL.

    With retry_s, every operation is retried through a lost connection or a full disk for that long
    (sltune.store.faults): what workers use, so a database restart costs a job nothing. Operations a retry
    could repeat after their first commit landed (creating a job or a trial) find their row and succeed."""

    def __init__(self, url: str, retry_s: float = 0.0):
        self.url = url
        self.retry_s = retry_s
        self.Session = sessions(url)

    # -- jobs --------------------------------------------------------------------------------------
    def create_job(self, name: str, spec: dict[str, Any], spec_hash: str, requirements: dict[str, Any],
                   job_id: str | None = None, status: str = "queued", limits: dict[str, Any] | None = None) -> Job:
        job = Job(id=job_id or uuid.uuid4().hex[:12], name=name, spec=spec, spec_hash=spec_hash, status=status,
                  limits=limits,
                  started_at=now() if status == "running" else None,
                  requirements=requirements, progress={"trials_done": 0, "max_trials": spec["search"]["max_trials"]})
        with self.Session.begin() as s:
            if job_id is not None and (held := s.get(Job, job_id)) is not None and held.spec_hash == spec_hash:
                return held          # a retry whose first attempt landed
            s.add(job)
        return job

    def job(self, job_id: str) -> Job | None:
        with self.Session() as s:
            return s.get(Job, job_id)

    def jobs(self, limit: int = 100, status: str | None = None) -> list[Job]:
        with self.Session() as s:
            q = select(Job).order_by(Job.created_at.desc()).limit(limit)
            if status:
                q = q.where(Job.status == status)
            return list(s.scalars(q))

    def job_summaries(self, limit: int = 100, status: str | None = None) -> list[dict[str, Any]]:
        """The newest jobs' list view in one narrow query: no spec, and of the result (which holds every
        trial) only its best, extracted by the database."""
        cols = (Job.id, Job.name, Job.status, Job.progress, Job.created_at, Job.started_at, Job.finished_at,
                Job.result["best"].label("best"), Job.error)
        q = select(*cols).order_by(Job.created_at.desc()).limit(limit)
        if status:
            q = q.where(Job.status == status)
        with self.Session() as s:
            rows = s.execute(q)
            keys = list(rows.keys())
            return [dict(zip(keys, row)) for row in rows]     # a fifth faster than Row._asdict()

    def resumable(self, spec_hash: str) -> Job | None:
        """The newest unfinished job with this exact spec: a re-run of the same command resumes it."""
        with self.Session() as s:
            return s.scalars(select(Job).where(Job.spec_hash == spec_hash, Job.status.in_(ACTIVE))
                             .order_by(Job.created_at.desc()).limit(1)).first()

    def set_status(self, job_id: str, status: str, holder: str | None = None, **fields: Any) -> bool:
        """Set a job's status; with holder, only while that worker holds it (a fenced write)."""
        values: dict[str, Any] = {"status": status, **fields}
        if status in FINISHED:
            values["finished_at"] = now()
            values["lease_expires_at"] = None
        with self.Session.begin() as s:
            return s.execute(update(Job).where(Job.id == job_id, *self._held(holder)).values(**values)).rowcount == 1

    def update_progress(self, job_id: str, progress: dict[str, Any], holder: str | None = None) -> bool:
        with self.Session.begin() as s:
            return s.execute(update(Job).where(Job.id == job_id, *self._held(holder))
                             .values(progress=progress)).rowcount == 1

    @staticmethod
    def _held(worker_id: str | None) -> tuple:
        return () if worker_id is None else (Job.worker_id == worker_id, Job.status == "running")

    def fail_if_queued(self, job_id: str, error: str) -> bool:
        with self.Session.begin() as s:
            res = s.execute(update(Job).where(Job.id == job_id, Job.status == "queued")
                            .values(status="failed", error=error, finished_at=now()))
            return res.rowcount == 1

    def request_cancel(self, job_id: str) -> Job | None:
        """Queued jobs are cancelled now; a running one is asked to stop (its worker checks)."""
        with self.Session.begin() as s:
            job = s.get(Job, job_id, with_for_update=True)
            if job is None:
                return None
            if job.status == "queued":
                job.status, job.finished_at = "cancelled", now()
            elif job.status == "running":
                job.cancel_requested = True
            return job

    def cancel_requested(self, job_id: str) -> bool:
        with self.Session() as s:
            return bool(s.scalar(select(Job.cancel_requested).where(Job.id == job_id)))

    # -- workers -----------------------------------------------------------------------------------
    def claim(self, worker_id: str, can_run, lease_s: float) -> Job | None:
        """Atomically take a queued job (or one whose worker's lease ran out) that this worker can run.

        PostgreSQL: SELECT ... FOR UPDATE SKIP LOCKED, so concurrent workers never see the same row.
        SQLite: a conditional UPDATE ... WHERE status/lease still as read; whoever updates the row wins.
        """
        t = now()
        claimable = or_(Job.status == "queued",
                        and_(Job.status == "running", Job.lease_expires_at < t))
        with self.Session.begin() as s:
            q = select(Job).where(claimable).order_by(Job.created_at, Job.id)
            if is_postgres(self.url):
                q = q.with_for_update(skip_locked=True)
            for job in s.scalars(q):       # streamed: jobs this worker cannot run do not hide later ones
                if not can_run(job.requirements):
                    continue
                res = s.execute(
                    update(Job).where(Job.id == job.id, Job.status == job.status,
                                      or_(Job.lease_expires_at.is_(None), Job.lease_expires_at == job.lease_expires_at))
                    .values(status="running", worker_id=worker_id, lease_expires_at=t + timedelta(seconds=lease_s),
                            heartbeat_at=t, attempts=job.attempts + 1, started_at=job.started_at or t)
                    .execution_options(synchronize_session=False))
                if res.rowcount == 1:
                    return s.get(Job, job.id, populate_existing=True)
        return None

    def claim_job(self, job_id: str, worker_id: str, lease_s: float) -> bool:
        """Take this one job if it is queued, or running with no live lease; False if someone holds it."""
        t = now()
        free = or_(Job.status == "queued", and_(Job.status == "running",
                                                or_(Job.lease_expires_at.is_(None), Job.lease_expires_at < t)))
        with self.Session.begin() as s:
            res = s.execute(update(Job).where(Job.id == job_id, free).values(
                status="running", worker_id=worker_id, lease_expires_at=t + timedelta(seconds=lease_s),
                heartbeat_at=t, attempts=Job.attempts + 1, started_at=func.coalesce(Job.started_at, t)))
            return res.rowcount == 1

    def take_over(self, job_id: str, dead: str, worker_id: str, lease_s: float) -> bool:
        """Take a running job from a holder known to be dead (its lease has not run out yet)."""
        t = now()
        with self.Session.begin() as s:
            res = s.execute(update(Job).where(Job.id == job_id, Job.status == "running", Job.worker_id == dead)
                            .values(worker_id=worker_id, lease_expires_at=t + timedelta(seconds=lease_s),
                                    heartbeat_at=t, attempts=Job.attempts + 1))
            return res.rowcount == 1

    def owns(self, job_id: str, worker_id: str | None) -> bool:
        """Does this worker still hold the job? (None: no fencing, the caller is the only runner.)"""
        if worker_id is None:
            return True
        with self.Session() as s:
            return s.scalar(select(Job.id).where(Job.id == job_id, Job.worker_id == worker_id,
                                                 Job.status == "running")) is not None

    def heartbeat(self, job_id: str, worker_id: str, lease_s: float) -> bool:
        """Extend the lease; False if this worker no longer holds the job."""
        t = now()
        with self.Session.begin() as s:
            res = s.execute(update(Job).where(Job.id == job_id, Job.worker_id == worker_id, Job.status == "running")
                            .values(heartbeat_at=t, lease_expires_at=t + timedelta(seconds=lease_s)))
            return res.rowcount == 1

    def register_worker(self, worker_id: str, capabilities: dict[str, Any]) -> None:
        with self.Session.begin() as s:
            row = s.get(Worker, worker_id)
            if row is None:
                s.add(Worker(id=worker_id, capabilities=capabilities))
            else:
                row.capabilities, row.last_seen = capabilities, now()

    def touch_worker(self, worker_id: str) -> None:
        with self.Session.begin() as s:
            s.execute(update(Worker).where(Worker.id == worker_id).values(last_seen=now()))

    def remove_worker(self, worker_id: str) -> None:
        with self.Session.begin() as s:
            row = s.get(Worker, worker_id)
            if row is not None:
                s.delete(row)

    def prune_workers(self, silent_for_s: float) -> int:
        """Forget workers not seen for this long (dead ones; a live worker touches its row every poll or
        heartbeat). Returns how many rows went."""
        with self.Session.begin() as s:
            return s.execute(delete(Worker).where(Worker.last_seen < now() - timedelta(seconds=silent_for_s))).rowcount

    def live_workers(self, within_s: float) -> list[Worker]:
        with self.Session() as s:
            return list(s.scalars(select(Worker).where(Worker.last_seen >= now() - timedelta(seconds=within_s))))

    # -- trials ------------------------------------------------------------------------------------
    def trials(self, job_id: str) -> list[Trial]:
        with self.Session() as s:
            return list(s.scalars(select(Trial).where(Trial.job_id == job_id).order_by(Trial.number)))

    def trial(self, job_id: str, number: int) -> Trial | None:
        with self.Session() as s:
            return s.scalars(select(Trial).where(Trial.job_id == job_id, Trial.number == number)).first()

    def start_trial(self, job_id: str, number: int, role: str, config: dict[str, Any], predicted: dict[str, Any],
                    optuna_number: int | None, worker_id: str | None) -> bool:
        """Record a trial as running; False (nothing written) if worker_id no longer holds the job."""
        with self.Session.begin() as s:
            if worker_id is not None:
                held = s.scalar(select(Job.id).where(Job.id == job_id, *self._held(worker_id)).with_for_update())
                if held is None:
                    return False
            if s.scalar(select(Trial.id).where(Trial.job_id == job_id, Trial.number == number,
                                               Trial.worker_id == worker_id, Trial.status == "running")) is not None:
                return True         # a retry whose first attempt landed
            s.add(Trial(job_id=job_id, number=number, role=role, config=config, status="running",
                        predicted=predicted, optuna_number=optuna_number, worker_id=worker_id))
            return True

    def finish_trial(self, job_id: str, number: int, result: dict[str, Any], worker_id: str | None = None) -> bool:
        """Record a trial's result; with worker_id, only while that worker still holds the job."""
        fence = () if worker_id is None else (
            Trial.worker_id == worker_id,
            select(Job.id).where(Job.id == job_id, *self._held(worker_id)).exists())
        with self.Session.begin() as s:
            return s.execute(update(Trial).where(Trial.job_id == job_id, Trial.number == number, *fence).values(
                status=result["status"], result=result, tokens_per_s=result.get("tokens_per_s"),
                peak_device_bytes=result.get("peak_device_bytes"), peak_host_bytes=result.get("peak_host_bytes"),
                finished_at=now())).rowcount == 1

    def interrupt_running_trials(self, job_id: str, worker_id: str | None = None) -> int:
        """Trials left 'running' (by a dead process, or this worker's, when given): run again later."""
        only = () if worker_id is None else (Trial.worker_id == worker_id,)
        with self.Session.begin() as s:
            res = s.execute(update(Trial).where(Trial.job_id == job_id, Trial.status == "running", *only)
                            .values(status="interrupted", finished_at=now()))
            return res.rowcount

    # -- fits and artifacts ------------------------------------------------------------------------
    def save_fit(self, job_id: str, kind: str, n_trials: int, payload: dict[str, Any]) -> None:
        with self.Session.begin() as s:
            s.add(Fit(job_id=job_id, kind=kind, n_trials=n_trials, payload=payload))

    def fits(self, job_id: str) -> list[Fit]:
        with self.Session() as s:
            return list(s.scalars(select(Fit).where(Fit.job_id == job_id).order_by(Fit.id)))

    def latest_fits(self, job_id: str) -> dict[str, dict[str, Any]]:
        """The newest fit of each kind (one row each, however many refits there were)."""
        newest = select(func.max(Fit.id)).where(Fit.job_id == job_id).group_by(Fit.kind)
        with self.Session() as s:
            return {f.kind: f.payload for f in s.scalars(select(Fit).where(Fit.id.in_(newest)))}

    def save_rates(self, machine: str, workload: str, rates: dict[str, Any]) -> None:
        with self.Session.begin() as s:
            s.add(Calibration(machine=machine, workload=workload, rates=rates))

    def latest_rates(self, machine: str, workload: str, prefix: bool = False) -> Calibration | None:
        """The newest rates calibrated on this machine for this workload key (`prefix`: for any key that starts
        with it: the same shapes, measured with any threads or folder), if any."""
        key = Calibration.workload.startswith(workload, autoescape=True) if prefix else Calibration.workload == workload
        with self.Session() as s:
            return s.scalars(select(Calibration).where(Calibration.machine == machine, key)
                             .order_by(Calibration.id.desc()).limit(1)).first()

    def all_rates(self, limit: int = 100) -> list[Calibration]:
        """The stored calibrations, newest first."""
        with self.Session() as s:
            return list(s.scalars(select(Calibration).order_by(Calibration.id.desc()).limit(limit)))

    def add_artifact(self, job_id: str, trial_number: int | None, kind: str, path: str, nbytes: int) -> None:
        with self.Session.begin() as s:
            s.add(Artifact(job_id=job_id, trial_number=trial_number, kind=kind, path=path, bytes=nbytes))

    def traced_trials(self, job_id: str) -> set[int]:
        """Numbers of the job's trials that have a trace, in one query."""
        with self.Session() as s:
            return set(s.scalars(select(Artifact.trial_number).where(Artifact.job_id == job_id,
                                                                     Artifact.kind == "trace")))

    def artifact(self, job_id: str, trial_number: int, kind: str) -> Artifact | None:
        with self.Session() as s:
            return s.scalars(select(Artifact).where(Artifact.job_id == job_id, Artifact.trial_number == trial_number,
                                                    Artifact.kind == kind)).first()
