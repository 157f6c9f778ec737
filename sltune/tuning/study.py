"""The job's Optuna study as Optuna's own tools read it (optuna.load_study, optuna.importance,
optuna-dashboard): the metric is named, a trial that measured nothing is FAIL with its reason, and what
sltune measured beyond the objective rides along as user attributes."""

from __future__ import annotations

import warnings
from typing import Any

import optuna

METRIC = "tokens_per_s"
# TrialResult fields worth seeing beside the objective (timing: the spread over the timed steps)
ATTRS = ("step_seconds", "peak_device_bytes", "peak_host_bytes", "oom_resource", "breakdown", "breakdown_seconds",
         "timing", "io")


def study_name(job_id: str) -> str:
    return f"sltune-{job_id}"


def param_importances(storage: optuna.storages.BaseStorage, job_id: str) -> dict[str, float] | None:
    """How much each knob explains of tokens/s (optuna.importance's default evaluator), or None while the
    study has too few complete trials, or no variation, to say."""
    try:
        study = optuna.load_study(study_name=study_name(job_id), storage=storage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optuna.importance.get_param_importances(study) or None
    except (KeyError, ValueError, RuntimeError):
        return None


def name_metric(study: optuna.Study) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([METRIC])


def tell(study: optuna.Study, trial: optuna.Trial, result: dict[str, Any], role: str, number: int) -> None:
    """An ok trial is COMPLETE with its tokens/s; oom, failed and timeout are FAIL (no throughput was
    measured: a 0 would read as a real, terrible value), with the status and the reason as attributes."""
    attrs = {"sltune_trial": number, "role": role, "status": result["status"],
             **{k: result[k] for k in ATTRS if result.get(k) is not None}}
    if result["status"] != "ok":
        attrs["reason"] = result.get("error")
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    if result["status"] == "ok":
        study.tell(trial, result[METRIC])
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
