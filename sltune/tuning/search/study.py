"""The job's Optuna study as Optuna's own tools read it (optuna.load_study, optuna.importance,
optuna-dashboard): the metric is named, a trial that measured nothing is FAIL with its reason, and what
sltune measured beyond the objective rides along as user attributes."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Callable

import optuna

from sltune.store.faults import durable_rdb_storage, retrying
from sltune.store.optuna import optuna_location

METRIC = "tokens_per_s"
# TrialResult fields worth seeing beside the objective (timing: the spread over the timed steps)
ATTRS = ("step_seconds", "peak_device_bytes", "peak_host_bytes", "oom_resource", "breakdown", "breakdown_seconds",
         "timing", "io")


def study_name(job_id: str) -> str:
    return f"sltune-{job_id}"


_STORAGES: dict[str, optuna.storages.RDBStorage] = {}
_STORAGE_LOCK = threading.Lock()


def optuna_storage(url: str, retry_s: float = 0.0) -> optuna.storages.RDBStorage:
    """One Optuna storage per database and process. Creating it creates Optuna's tables, which two job
    threads (or two processes on a new database) must not do at once: a lock here, one retry across
    processes. With retry_s its calls ride out a database restart as the job store's do (a worker's)."""
    url, kwargs = optuna_location(url)       # beside the job store, never among its tables
    with _STORAGE_LOCK:
        if url not in _STORAGES:
            try:
                _STORAGES[url] = retrying(lambda: durable_rdb_storage(url, kwargs), retry_s,
                                          "opening Optuna's storage")
            except Exception:  # noqa: BLE001 - another process created the tables first; they exist now
                time.sleep(1.0)
                _STORAGES[url] = durable_rdb_storage(url, kwargs)
        _STORAGES[url].retry_s = max(_STORAGES[url].retry_s, retry_s)
        return _STORAGES[url]


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


def _attrs(result: dict[str, Any], role: str, number: int) -> dict[str, Any]:
    attrs = {"sltune_trial": number, "role": role, "status": result["status"],
             **{k: result[k] for k in ATTRS if result.get(k) is not None}}
    if result["status"] != "ok":
        attrs["reason"] = result.get("error")
    return attrs


def tell(study: optuna.Study, trial: optuna.Trial, result: dict[str, Any], role: str, number: int,
         layers: int | None = None) -> None:
    """An ok trial is COMPLETE with its tokens/s; oom, failed and timeout are FAIL (no throughput was
    measured: a 0 would read as a real, terrible value), with the status and the reason as attributes; so is
    diverged (measured, but not training the model correctly: never Optuna's best_trial either). A probe
    at reduced depth (`layers` decoder layers) measured a smaller model: PRUNED, its tokens/s an intermediate
    value at step `layers`, so that Optuna's best_trial is always one of the whole model."""
    for key, value in _attrs(result, role, number).items():
        trial.set_user_attr(key, value)
    if layers is not None:
        trial.set_user_attr("num_layers", layers)
        if result["status"] == "ok":
            trial.report(result[METRIC], step=layers)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return
    if result["status"] == "ok":
        study.tell(trial, result[METRIC])
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def add_confirms(study: optuna.Study, params: Callable[[Any], dict[str, Any]],
                 distributions: dict[str, optuna.distributions.BaseDistribution], confirms: list) -> None:
    """The confirmation trials (sltune.tuning.search.state.FinishedTrial, role "confirm") the study lacks, added as
    finished trials: the sampler never proposed them, but Optuna's tools should see every measurement the pick rests
    on. Ones already there (by their sltune_trial attribute) are skipped, so a resumed job adds only what a
    killed one had not. Each has the distributions of its own parameters (a backend's, in a space of several)."""
    have = {t.user_attrs.get("sltune_trial") for t in study.get_trials(deepcopy=False)}
    for d in confirms:
        if d.number in have:
            continue
        ok = d.result["status"] == "ok"
        own = params(d.candidate)
        study.add_trial(optuna.trial.create_trial(
            params=own, distributions={name: distributions[name] for name in own},
            value=d.result[METRIC] if ok else None,
            state=optuna.trial.TrialState.COMPLETE if ok else optuna.trial.TrialState.FAIL,
            user_attrs=_attrs(d.result, d.role, d.number)))


def set_pick(study: optuna.Study, result: dict[str, Any]) -> None:
    """sltune's answer beside Optuna's own best_trial (which is the single fastest trial, and may be another
    config, or a confirmation trial of a round the machine ran faster): the pick, its figure (the median of
    all its trials) and interval, the trials it pools and how sure the pick is."""
    best = result.get("best")
    if not best:
        return
    numbers = set(best.get("from_trials") or [])
    optuna_numbers = [t.number for t in study.get_trials(deepcopy=False) if t.user_attrs.get("sltune_trial") in numbers]
    for key, value in (("pick", best["config"]), ("pick_tokens_per_s", best["tokens_per_s"]),
                       ("pick_tokens_per_s_ci95", best.get("tokens_per_s_ci95")),
                       ("pick_trials", sorted(numbers)), ("pick_optuna_trials", optuna_numbers),
                       ("pick_confidence", result.get("confidence"))):
        study.set_user_attr(key, value)
