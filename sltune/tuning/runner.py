"""Running a tuning job: propose, run an isolated trial, record it, refit, report progress; resumable.

The job's trials live in the store and its Optuna study in the same database, so a job killed at any
point and started again (same spec, same --db) picks up where it was: finished trials are read back,
a trial that was running is marked interrupted and run again, nothing finished runs twice.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import optuna

from sltune.profiling import run_trial
from sltune.profiling.schema import TrialSpec
from sltune.store import Store
from sltune.sizes import format_bytes
from sltune.store.faults import durable_rdb_storage, retrying
from sltune.store.optuna import optuna_location
from sltune.tuning import confirm
from sltune.tuning.baseline import trial_baseline
from sltune.tuning.feasible import free_bytes
from sltune.tuning.result import job_result
from sltune.tuning.shape import shape_of
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec
from sltune.tuning.state import Done, SearchState
from sltune.tuning.strategies import STRATEGIES, Stop
from sltune.tuning.study import add_confirms, name_metric, set_pick, study_name, tell

optuna.logging.set_verbosity(optuna.logging.WARNING)
log = logging.getLogger("sltune.tuning")

ProgressFn = Callable[[dict[str, Any]], None]
# should_stop returns None to go on, "cancelled: ..." to end the job as cancelled, or "released: ..." to
# hand it back unfinished (a worker shutting down or losing its lease): the trial in flight is killed and
# marked interrupted either way, so a resumed job runs it again.
StopFn = Callable[[], str | None]
MAX_REPEATS = 200   # asks that return an already-tried or invalid config before the sampler is given up on


def machine_cores() -> int:
    """The cores this process may run on (its affinity), which its trials share."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        return os.cpu_count() or 1


def requirements(spec: TuningSpec) -> dict[str, Any]:
    """What a worker must offer to run this job."""
    hw = spec.hardware
    return {"device": hw.device_kind, "device_memory_limit": hw.device_memory_limit, "world_size": hw.world_size}


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


def run_job(store: Store, job_id: str, *, progress: ProgressFn | None = None, should_stop: StopFn | None = None,
            worker_id: str | None = None, artifact_dir: Path | None = None,
            default_host_limit: int | None = None, max_trial_steps: int | None = None,
            max_trials: int | None = None, offload_root: Path | None = None) -> dict[str, Any]:
    """Run (or resume) a job. With worker_id every write is fenced: a runner that lost the job writes
    nothing more. default_host_limit is this worker's ceiling on a trial's host memory, whatever the spec
    says, so no trial can take the machine (and the server beside it) down; max_trial_steps its ceiling on a
    trial's timed steps, and max_trials on the job's trials in all, confirmation trials included (as is the
    server's, recorded in the job's limits). offload_root is where trials of optimizer_offload disk keep their
    files (a folder per job and trial, removed after each; default: beside artifact_dir, else a temporary
    folder); its free space bounds their disk beside the spec's hardware.disk_limit."""
    job = store.job(job_id)
    if job is None:
        raise ValueError(f"no job {job_id!r} in {store.url}")
    in_all = [n for n in (max_trials, ((job.limits or {}).get("trials_in_all") or {}).get("applied")) if n]
    trials_cap = min(in_all) if in_all else None
    spec = TuningSpec.model_validate(job.spec)
    shape = shape_of(spec.model.source, spec.model.dtype)
    space = SearchSpace(spec, shape)
    hw = spec.hardware      # the host prior holds what a trial process holds before its model, measured here
    baseline = trial_baseline(hw.device, hw.world_size, spec.workload.mode, hw.cpu_threads)
    if offload_root is None:
        offload_root = (Path(artifact_dir).parent if artifact_dir is not None
                        else Path(tempfile.gettempdir())) / "offload"
    # a previous holder killed mid-trial left its trial's optimizer files: this runner holds the job, so no trial of
    # it runs anywhere else, and the room they took is free again before the disk ceiling is read
    shutil.rmtree(offload_root / job_id, ignore_errors=True)
    on_disk = any(c.on_disk for c in space.candidates)
    state = SearchState(spec, shape, space, baseline=baseline, host_ceiling=default_host_limit,
                        disk_ceiling=free_bytes(offload_root) if on_disk else None)
    if worker_id is None:
        store.set_status(job_id, "running")
    store.interrupt_running_trials(job_id)          # left running by a previous holder that died
    finished = [t for t in store.trials(job_id) if t.status not in ("running", "interrupted")]
    # each config's trial times, search and confirmation apart (a confirmation trial is neither profiled nor timed
    # twice): what its next trial will take
    seconds: dict[tuple[Candidate, bool], list[float]] = {}
    for t in finished:   # replayed in order: margins widened by past out-of-memory trials come back too
        done = Done(t.number, Candidate.from_knobs(t.config), t.role, t.result)
        if t.started_at and t.finished_at and not state.reduced(done):     # what a full-depth trial takes
            seconds.setdefault((done.candidate, t.role == "confirm"), []).append(
                (t.finished_at - t.started_at).total_seconds())
        if t.role == "confirm":
            state.confirms.append(done)         # not search history: they neither refit nor count as tried
        else:
            state.add(done)
    if not finished:
        state.refit()           # fits (empty) exist before the first proposal
    number = max((t.number for t in store.trials(job_id)), default=-1) + 1

    study = optuna.create_study(study_name=study_name(job_id), storage=optuna_storage(store.url, store.retry_s),
                                direction="maximize", load_if_exists=True,
                                sampler=STRATEGIES[spec.search.strategy](state, spec.search.seed).sampler())
    name_metric(study)
    # Optuna trials left running by a dead process. The store is the record: a trial it holds as
    # finished (killed between writing the row and telling Optuna) is told its result now.
    by_number = {t.optuna_number: t for t in finished if t.optuna_number is not None}
    for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        row = by_number.get(stale.number)
        if row is not None:
            tell(study, optuna.Trial(study, stale._trial_id), row.result, row.role, row.number,
                 state.depth_of(Done(row.number, Candidate.from_knobs(row.config), row.role, row.result)))
        else:
            study.tell(stale.number, state=optuna.trial.TrialState.FAIL)
    add_confirms(study, space.params, space.distributions(), state.confirms)   # killed before adding them
    strategy = STRATEGIES[spec.search.strategy](state, spec.search.seed)

    search = spec.search
    elapsed_before = float(job.progress.get("elapsed_s", 0.0))
    start = time.monotonic()
    trial_seconds: list[float] = []
    picks: list[Candidate] = []         # the confirmation round's finalists, once the search has ended
    repeats = 0
    stop_reason = None

    def elapsed() -> float:
        return elapsed_before + time.monotonic() - start

    def report(last: dict[str, Any] | None = None, phase: str = "running", best: Done | None = None,
               figure: float | None = None) -> None:
        best = best or state.best()         # finished: the confirmed winner and its figure, as the result names
        done = len(state.history)
        avg = sum(trial_seconds) / len(trial_seconds) if trial_seconds else None
        # the confirmation trials that will still run: as many as the server's cap on trials in all leaves (a
        # capped job said 40 planned where none could run); finished, none (what ran is all there is)
        rest = confirm.remaining(state, picks, search.confirm_rounds) if phase == "confirm" else None
        if rest and trials_cap is not None:
            rest = rest[:max(0, trials_cap - len(state.history) - len(state.confirms))]
        if phase == "finished":
            rest = []
        left = confirm.time_left(state, search, elapsed(), rest, seconds, avg, trials_cap)
        if phase == "finished":
            left = 0.0
        payload = {"trials_done": done, "max_trials": search.max_trials, "confirm_done": len(state.confirms),
                   "confirm_planned": len(state.confirms) + len(rest) if rest is not None and len(picks) > 1 else None,
                   "elapsed_s": round(elapsed(), 2),
                   "time_left_s": max(0.0, round(left, 1)), "phase": phase, "stop_reason": stop_reason,
                   "best_tokens_per_s": figure if figure is not None else best.tokens_per_s if best else None,
                   "best_config": best.candidate.knobs() if best else None, "last_trial": last}
        store.update_progress(job_id, payload, holder=worker_id)
        if progress:
            progress(payload)

    def measure(cand: Candidate, role: str, optuna_number: int | None,
                layers: int | None = None) -> dict[str, Any] | None:
        """Run one trial (of `layers` decoder layers: a probe at reduced depth; None: the whole model) and record
        it; None (stop_reason set) when the job was stopped or taken over."""
        nonlocal stop_reason
        began = time.monotonic()       # the trial's whole cost, its records included: what the next will take
        pred = state.predict(cand, layers=layers)
        trace = trace_error = None
        if search.profile and artifact_dir is not None and role != "confirm":
            trace = Path(artifact_dir) / job_id / f"trial-{number}.json"
            try:
                trace.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:          # a full disk costs the trial its trace, nothing more
                trace, trace_error = None, f"no trace: its folder could not be made ({err.strerror})"
        depth = {"num_layers": layers} if layers is not None else {}
        if not store.start_trial(job_id, number, role, {**cand.knobs(), "schedule": search.schedule, **depth},
                                 pred.to_dict(), optuna_number, worker_id):
            stop_reason = "released: another worker holds the job now"
            return None
        report(last={"number": number, "config": cand.knobs(), "status": "running"}, phase=role)
        t0 = time.monotonic()
        folder = offload_root / job_id / f"trial-{number}" if cand.on_disk else None
        try:
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
            result = run_trial(trial_spec(spec, cand, trace, default_host_limit, max_trial_steps, layers, folder,
                                          confirming=role == "confirm"),
                               stop=should_stop).model_dump(mode="json")
        finally:
            if folder is not None:       # the optimizer's files are the trial's alone: gone with it
                shutil.rmtree(folder, ignore_errors=True)
                _remove_if_empty(folder.parent)
        if trace is not None and result["status"] == "ok" and not trace.exists():
            trace, trace_error = None, f"no trace: it could not be written ({free_space(artifact_dir)})"
        if trace_error:
            result["trace_error"] = trace_error
        trial_seconds.append(time.monotonic() - t0)
        if should_stop and (why := should_stop()) and result["status"] == "failed":
            store.interrupt_running_trials(job_id, worker_id)   # killed mid-way: not a result, run it again
            stop_reason = why
            return None
        if not store.finish_trial(job_id, number, result, worker_id=worker_id):
            stop_reason = "released: another worker holds the job now"     # fenced: the job has a new holder
            return None
        if trace is not None and trace.exists():
            try:
                store.add_artifact(job_id, number, "trace", str(trace.relative_to(artifact_dir)), trace.stat().st_size)
            except Exception as err:  # noqa: BLE001 - the trial's result is stored; only its trace is lost
                log.warning("job %s trial %d: its trace could not be recorded (%s)", job_id, number, err)
        if layers is None:
            seconds.setdefault((cand, role == "confirm"), []).append(time.monotonic() - began)
        return result

    report(phase="starting")
    while True:
        if len(state.history) >= search.max_trials:
            stop_reason = f"max_trials ({search.max_trials}) reached"
            break
        if elapsed() >= search.time_budget_s:
            stop_reason = f"time_budget_s ({search.time_budget_s:g}s) used up"
            break
        if should_stop and (why := should_stop()):
            stop_reason = why
            break
        proposal = strategy.propose()
        if isinstance(proposal, Stop):
            stop_reason = proposal.reason
            break
        if proposal.candidate is not None:
            study.enqueue_trial(space.params(proposal.candidate))
        ot = study.ask(space.distributions())
        cand = space.candidate(ot.params)
        if cand is None or state.ran(cand, proposal.layers):
            prev = next((d for d in state.history if d.candidate == cand and state.depth_of(d) == proposal.layers),
                        None)
            if prev is not None and prev.result["status"] == "ok":
                study.tell(ot, prev.tokens_per_s)
            else:
                study.tell(ot, state=optuna.trial.TrialState.PRUNED)
            repeats += 1
            if repeats > MAX_REPEATS:
                stop_reason = "the sampler keeps proposing configs already tried"
                break
            continue

        result = measure(cand, proposal.role, ot.number, proposal.layers)
        if result is None:
            study.tell(ot, state=optuna.trial.TrialState.FAIL)
            break
        done = Done(number, cand, proposal.role, result)
        tell(study, ot, result, proposal.role, number, state.depth_of(done))
        state.add(done)
        for kind, fit in state.fits.items():
            store.save_fit(job_id, kind, fit.n, fit.to_dict())
        report(last={"number": number, "config": cand.knobs(), "status": result["status"],
                     "tokens_per_s": result.get("tokens_per_s"), "error": result.get("error")}, phase=proposal.role)
        number += 1

    confirmation = None
    if not stop_reason.startswith(("cancelled", "released")):
        picks = confirm.finalists(state) if search.confirm_rounds else []
        while rest := confirm.remaining(state, picks, search.confirm_rounds):    # a race: the beaten drop out
            cand = rest[0]
            if trials_cap is not None and len(state.history) + len(state.confirms) >= trials_cap:
                stop_reason += (f"; confirmation cut short: this server allows {trials_cap} trials in all, "
                                "confirmation included (SLTUNE_MAX_TRIALS)")
                break
            if elapsed() >= search.time_budget_s:
                stop_reason += f"; confirmation cut short: time_budget_s ({search.time_budget_s:g}s) used up"
                break
            if should_stop and (why := should_stop()):
                stop_reason = why
                break
            result = measure(cand, "confirm", None)
            if result is None:
                break
            state.confirms.append(Done(number, cand, "confirm", result))
            add_confirms(study, space.params, space.distributions(), state.confirms[-1:])
            report(last={"number": number, "config": cand.knobs(), "status": result["status"],
                         "tokens_per_s": result.get("tokens_per_s"), "error": result.get("error")}, phase="confirm")
            number += 1
        confirmation = confirm.verdict(state, picks)

    out = job_result(job_id, spec, state, stop_reason, elapsed(), confirmation)
    if stop_reason and stop_reason.startswith("released"):
        store.update_progress(job_id, {**store.job(job_id).progress, "phase": "released", "stop_reason": stop_reason},
                              holder=worker_id)
        out["status"], out["error"] = "released", None
        return out
    cancelled = bool(stop_reason and stop_reason.startswith("cancelled"))
    status = "cancelled" if cancelled else ("succeeded" if out["best"] else "failed")
    error = None if out["best"] or cancelled else ("no config ran successfully: " + _failures(state))
    report(phase="finished", best=confirm.winner_of(state, confirmation),
           figure=out["best"]["tokens_per_s"] if out["best"] else None)
    set_pick(study, out)
    store.set_status(job_id, status, holder=worker_id, result=out, error=error)
    out["status"] = status
    out["error"] = error
    return out


def _failures(state: SearchState) -> str:
    errs = [f"{d.candidate}: {d.result['status']} ({d.result.get('error')})" for d in state.history[-3:]]
    return "; ".join(errs) or "no trial ran"


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def free_space(folder: Path | None) -> str:
    try:
        return f"{format_bytes(shutil.disk_usage(folder).free)} free in the data directory"
    except (OSError, TypeError):
        return "the data directory cannot be read"


def trial_spec(spec: TuningSpec, c: Candidate, trace: Path | None, default_host_limit: int | None = None,
               max_trial_steps: int | None = None, layers: int | None = None,
               offload_dir: Path | None = None, confirming: bool = False) -> TrialSpec:
    """What one trial runs. The worker's ceilings hold whatever the stored spec says: host memory; timed steps,
    every round together (an unstable round is re-measured only while both fit); and intra-op threads, at most
    this machine's cores shared by the ranks (more would only take turns on them). A probe at reduced depth
    (`layers`) times its steps for that share of trial_min_time_s: as many steps as the whole model's would. A
    config of optimizer_offload disk writes its files in `offload_dir`, the runner's folder for the trial (never
    a path from the spec). A confirmation trial (`confirming`) only times its steps, once: its config's breakdown
    and trace are its search trial's, and the paired rounds are its re-measurement (a round of its own measured
    again would pick the quieter of two moments for one finalist and not for the others); it cost a search trial's
    time again under load (bench/tuner.py)."""
    w, hw, s = spec.workload, spec.hardware, spec.search
    min_time = s.trial_min_time_s
    if layers is not None:
        min_time *= min(1.0, layers / shape_of(spec.model.source, spec.model.dtype).layers)
    steps, max_steps, remeasure = s.trial_steps, s.trial_max_steps, 1
    if max_trial_steps is not None:
        steps, max_steps = min(steps, max_trial_steps), min(max_steps, max_trial_steps)
        remeasure = 1 if 2 * max(steps, max_steps) <= max_trial_steps else 0
    if confirming:
        remeasure = 0
    threads = hw.cpu_threads
    if threads is not None:
        threads = min(threads, max(1, machine_cores() // hw.world_size))
    return TrialSpec(model=spec.model.source, dtype=spec.model.dtype, mixed_precision=spec.model.mixed_precision,
                     optimizer=spec.optimizer, sub_batch_size=c.b, num_sub_batches=c.n,
                     num_live_blocks=c.k, schedule=s.schedule, activations=c.a, mode=w.mode,
                     kv_cache=c.kv_cache or "host", weights_on_device=c.w or 0.0, seq_len=w.seq_len,
                     prompt_len=w.prompt_len, new_tokens=w.new_tokens, world_size=hw.world_size, device=hw.device,
                     device_memory_limit=hw.device_memory_limit,
                     host_memory_limit=min((x for x in (hw.host_memory_limit, default_host_limit) if x),
                                           default=None),
                     steps=steps, min_time_s=min_time, max_steps=max_steps, remeasure=remeasure,
                     cpu_threads=threads, profile=s.profile and not confirming, trace_path=str(trace) if trace else None,
                     timeout_s=s.trial_timeout_s, seed=s.seed, num_layers=layers,
                     **({"optimizer_offload": "disk", "offload_dir": str(_required(offload_dir))}
                        if c.on_disk and w.mode == "train" else {}))


def _required(offload_dir: Path | None) -> Path:
    if offload_dir is None:
        raise ValueError("a config of optimizer_offload disk needs the runner's offload folder for its trial")
    return offload_dir
