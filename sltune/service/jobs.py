"""Jobs as the service sees them: submission within the configured bounds, and their public views."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException

from sltune.service.capabilities import can_run, why_not
from sltune.settings import Settings
from sltune.store import Job, Store
from sltune.tuning.runner import requirements
from sltune.tuning.shape import shape_of
from sltune.tuning.space import SearchSpace
from sltune.tuning.spec import TuningSpec


def check_bounds(spec: TuningSpec, settings: Settings) -> list[dict[str, Any]]:
    """The server's limits on what one request may ask for, as 422-style field errors."""
    s = spec.search
    errors = []
    for field, value, bound in (("max_trials", s.max_trials, settings.max_trials),
                                ("time_budget_s", s.time_budget_s, settings.max_time_budget_s),
                                ("trial_timeout_s", s.trial_timeout_s, settings.max_trial_timeout_s)):
        if value > bound:
            errors.append({"loc": ["body", "search", field], "type": "server_bound",
                           "msg": f"{value:g} is above this server's limit of {bound:g}; ask for at most {bound:g}"})
    biggest = max(c.batch for c in SearchSpace(spec, shape_of(spec.model.source, spec.model.dtype)).candidates)
    tokens = biggest * spec.workload.tokens_per_row
    if tokens > settings.max_tokens_per_step:
        errors.append({"loc": ["body", "search"], "type": "server_bound",
                       "msg": f"the largest config runs {tokens} tokens per step (sub_batch_size*num_sub_batches*"
                              f"tokens per row), above this server's limit of {settings.max_tokens_per_step}; "
                              "lower the largest batch or the sequence length"})
    return errors


def submit_job(store: Store, spec: TuningSpec, settings: Settings) -> Job:
    errors = check_bounds(spec, settings)
    if errors:
        raise HTTPException(422, errors)
    return store.create_job(spec.name, spec.model_dump(mode="json"), spec.digest(), requirements(spec))


def job_summary(job: Job) -> dict[str, Any]:
    result = job.result or {}
    return {"id": job.id, "name": job.name, "status": job.status, "progress": job.progress or {},
            "created_at": job.created_at, "started_at": job.started_at, "finished_at": job.finished_at,
            "best": result.get("best"), "error": job.error}


def job_detail(store: Store, job: Job, settings: Settings) -> dict[str, Any]:
    result = job.result or {}
    models = result.get("models")
    if models is None:
        models = store.latest_fits(job.id) or None       # while the job runs
    return {**job_summary(job), "spec": job.spec, "worker_id": job.worker_id, "attempts": job.attempts,
            "cancel_requested": job.cancel_requested, "predicted": result.get("predicted"),
            "binding_limit": result.get("binding_limit"), "models": models,
            "stop_reason": result.get("stop_reason"), "waiting_for": waiting_for(store, job, settings),
            "confidence": result.get("confidence"), "confirmation": result.get("confirmation")}


def waiting_for(store: Store, job: Job, settings: Settings) -> str | None:
    """Why a queued job has not started: no live worker at all, or none that can run it."""
    if job.status != "queued":
        return None
    live = store.live_workers(within_s=max(3 * settings.poll_seconds, settings.lease_seconds))
    if not live:
        return "no live worker; start one with `sltune worker --db URL` or `sltune serve`"
    if not any(can_run(w.capabilities, job.requirements) for w in live):
        reasons = sorted({why_not(w.capabilities, job.requirements) or "" for w in live})
        return f"no live worker can run this job: {'; '.join(reasons)}"
    return "a free worker"
