"""Jobs as the service sees them: their public views, and what a queued job waits for."""

from __future__ import annotations

import time
from typing import Any

from sltune.service.capabilities import can_run, why_not
from sltune.settings import Settings
from sltune.store import Job, Store


def job_summary(job: Job) -> dict[str, Any]:
    result = job.result or {}
    return {"id": job.id, "name": job.name, "status": job.status, "progress": job.progress or {},
            "created_at": job.created_at, "started_at": job.started_at, "finished_at": job.finished_at,
            "best": result.get("best"), "error": job.error}


def job_detail(store: Store, job: Job, settings: Settings) -> dict[str, Any]:
    result = job.result or {}
    models = result.get("models")
    if models is None and job.status != "queued":
        models = store.latest_fits(job.id) or None       # while the job runs
    return {**job_summary(job), "spec": job.spec, "worker_id": job.worker_id, "attempts": job.attempts,
            "cancel_requested": job.cancel_requested, "limits": job.limits, "predicted": result.get("predicted"),
            "binding_limit": result.get("binding_limit"), "models": models,
            "stop_reason": result.get("stop_reason"), "waiting_for": waiting_for(store, job, settings),
            "confidence": result.get("confidence"), "confirmation": result.get("confirmation"),
            "depth": result.get("depth"), "best_by_backend": result.get("best_by_backend"),
            "step_prior": result.get("step_prior")}


def waiting_for(store: Store, job: Job, settings: Settings) -> str | None:
    """Why a queued job has not started: no live worker at all, or none that can run it."""
    if job.status != "queued":
        return None
    live = _live_workers(store, settings)
    if not live:
        return "no live worker; start one with `sltune worker --db URL` or `sltune serve`"
    if not any(can_run(w.capabilities, job.requirements) for w in live):
        reasons = sorted({why_not(w.capabilities, job.requirements) or "" for w in live})
        return f"no live worker can run this job: {'; '.join(reasons)}"
    return "a free worker"


_LIVE: dict[str, tuple[float, list]] = {}


def _live_workers(store: Store, settings: Settings) -> list:
    """The live workers, at most `poll_seconds` old: workers touch their rows every few seconds, so one
    query per poll interval says the same as one per read of a queued job (a sixth of a read's cost)."""
    seen = _LIVE.get(store.url)
    if seen is None or time.monotonic() - seen[0] > settings.poll_seconds:
        seen = (time.monotonic(), store.live_workers(within_s=settings.alive_within_s))
        _LIVE[store.url] = seen
    return seen[1]
