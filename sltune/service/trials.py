"""A job's trials as GET /jobs/{id}/trials and the dashboards give them: each names its backend, SpeedLoader's too.

A SpeedLoader trial's stored config names no backend (as before there were backends; a DeepSpeed or FSDP trial's
does, or its result's config does): the view fills it in, in the config and beside it, so every trial of a job over
several backends says which ran it, a running one too.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from sltune.store import Store
from sltune.store.schema import Trial
from sltune.tuning.report.compare import backend_of, trial_config


def trial_view(job_id: str, trial: Trial, traced: bool) -> dict[str, Any]:
    """One trial: its number, role, status, config (naming its backend), predictions, TrialResult, times, backend,
    and its trace's URL when it has one (`traced`)."""
    config = trial_config({"config": trial.config, "result": trial.result})
    backend = backend_of(config)
    return {"number": trial.number, "role": trial.role, "status": trial.status,
            "config": {**config, "backend": backend}, "predicted": trial.predicted or {}, "result": trial.result,
            "started_at": trial.started_at, "finished_at": trial.finished_at, "backend": backend,
            "trace_url": f"/jobs/{quote(str(job_id), safe='')}/trials/{trial.number}/trace" if traced else None}


def trial_views(store: Store, job_id: str) -> list[dict[str, Any]]:
    """Every trial of the job, in order."""
    traced = store.traced_trials(job_id)
    return [trial_view(job_id, t, t.number in traced) for t in store.trials(job_id)]
