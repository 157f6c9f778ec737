"""Running a tuning job: propose, run an isolated trial, record it, refit, report progress; resumable.

The job's trials live in the store and its Optuna study in the same database, so a job killed at any
point and started again (same spec, same --db) picks up where it was: finished trials are read back,
a trial that was running is marked interrupted and run again, nothing finished runs twice.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import optuna

from sltune.backends import deepspeed_ops
from sltune.executors import executor_for
from sltune.models.confined import admitted_under, confinement, within
from sltune.profiling.schema import TrialSpec
from sltune.sizes import format_bytes
from sltune.store import Store
from sltune.tuning.cost.baseline import trial_baseline
from sltune.tuning.cost.feasible import free_bytes
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.cost.stored_rates import calibrated, stored_rates
from sltune.tuning.report.result import job_result
from sltune.tuning.search import confirm
from sltune.tuning.search.state import FinishedTrial, SearchState
from sltune.tuning.search.strategies import STRATEGIES, Proposal, Stop, Strategy
from sltune.tuning.search.study import add_confirms, name_metric, optuna_storage, set_pick, study_name, tell
from sltune.tuning.search.trials import trial_spec
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec

if TYPE_CHECKING:
    from sltune.executors.base import Executor
    from sltune.machine.rates import MachineRates

optuna.logging.set_verbosity(optuna.logging.WARNING)
log = logging.getLogger("sltune.tuning")

StopKind = Literal["exhausted", "converged", "too_slow", "max_trials", "time_budget", "stuck", "cancelled", "released"]


@dataclass(frozen=True)
class StopReason:
    """Why the search ended or the job was stopped. The runner decides by kind alone: "cancelled" ends the job as
    cancelled and "released" hands it back unfinished (neither runs the confirmation round); every other kind is
    the search ending by itself: the strategy's Stop ("exhausted", "converged", "too_slow"), a budget ("max_trials",
    "time_budget"), or a sampler that only repeats itself ("stuck"). text is what the job's result and progress
    say, word for word."""

    kind: StopKind
    text: str

    def cut_short(self, why: str) -> StopReason:
        """This reason, and why the confirmation round after the search ended early."""
        return replace(self, text=f"{self.text}; confirmation cut short: {why}")


TAKEN_OVER = StopReason("released", "released: another worker holds the job now")   # a fenced write was refused
ProgressFn = Callable[[dict[str, Any]], None]
# should_stop returns None to go on, a "cancelled" StopReason to end the job as cancelled, or a "released" one to
# hand it back unfinished (a worker shutting down or losing its lease): the trial in flight is killed and marked
# interrupted either way, so a resumed job runs it again.
StopFn = Callable[[], StopReason | None]
CALIBRATE_S = 60.0  # search.step_prior measure: the most a job's calibration takes (the goal on this machine)
MAX_REPEATS = 200   # asks that return an already-tried or invalid config before the sampler is given up on


@dataclass
class Launched:
    """A trial started (its row in the store), running or about to: what its record needs once it answers."""
    number: int
    candidate: Candidate
    role: str
    layers: int | None          # decoder layers it runs (a probe at reduced depth); None: the whole model
    optuna_trial: optuna.Trial | None
    spec: TrialSpec
    folder: Path | None         # the optimizer's files, the trial's alone: removed once it answers
    trace: Path | None
    trace_error: str | None
    began: float                # the trial's whole cost from here, its records included: what the next will take
    started: float              # as its processes start


def requirements(spec: TuningSpec) -> dict[str, Any]:
    """What a worker must offer to run this job: on a Ray cluster, the cluster (its nodes hold the ranks)."""
    hw = spec.hardware
    return {"device": hw.device_kind, "device_memory_limit": hw.device_memory_limit, "world_size": hw.world_size,
            **({"executor": hw.executor} if hw.executor != "local" else {})}


def run_job(store: Store, job_id: str, *, progress: ProgressFn | None = None, should_stop: StopFn | None = None,
            worker_id: str | None = None, artifact_dir: Path | None = None,
            default_host_limit: int | None = None, max_trial_steps: int | None = None,
            max_trials: int | None = None, offload_root: Path | None = None,
            ray_address: str | None = None) -> dict[str, Any]:
    """Run (or resume) a job. With worker_id every write is fenced: a runner that lost the job writes
    nothing more. default_host_limit is this worker's ceiling on a trial's host memory, whatever the spec
    says, so no trial can take the machine (and the server beside it) down; max_trial_steps its ceiling on a
    trial's timed steps, and max_trials on the job's trials in all, confirmation trials included (as is the
    server's, recorded in the job's limits). offload_root is where trials of optimizer_offload disk keep their
    files (a folder per job and trial, removed after each; default: beside artifact_dir, else a temporary
    folder); its free space bounds their disk beside the spec's hardware.disk_limit. A job a server admitted naming
    model.path reads its folder only inside the models_dir it was admitted under (sltune.models.confined), here and
    in each trial: a folder that now leads outside fails the job in one line. Its trials run where
    hardware.executor says (sltune.executors): on a Ray cluster, the one at ray_address (else RAY_ADDRESS)."""
    job = store.job(job_id)
    with within(admitted_under(job.limits if job is not None else None)):
        run = JobRun(store, job_id, progress=progress, should_stop=should_stop, worker_id=worker_id,
                     artifact_dir=artifact_dir, default_host_limit=default_host_limit,
                     max_trial_steps=max_trial_steps, max_trials=max_trials, offload_root=offload_root)
        run.executor = executor_for(run.spec.hardware.executor, ray_address)
        try:
            run.resume()
            run.search()
            run.confirm()
            return run.finish()
        finally:
            run.executor.close()


class JobRun:
    """One run of a job by one holder, in run_job's four steps: resume, search, confirm, finish."""

    study: optuna.Study
    strategy: Strategy
    executor: Executor          # where its trials run (run_job's, from hardware.executor)
    start: float                # the clock of this run (elapsed_before holds the runs before it)

    def __init__(self, store: Store, job_id: str, *, progress: ProgressFn | None, should_stop: StopFn | None,
                 worker_id: str | None, artifact_dir: Path | None, default_host_limit: int | None,
                 max_trial_steps: int | None, max_trials: int | None, offload_root: Path | None):
        job = store.job(job_id)
        if job is None:
            raise ValueError(f"no job {job_id!r} in {store.url}")
        self.store, self.job_id, self.worker_id = store, job_id, worker_id
        self.progress, self.should_stop = progress, should_stop
        self.artifact_dir = artifact_dir
        self.default_host_limit, self.max_trial_steps = default_host_limit, max_trial_steps
        in_all = [n for n in (max_trials, ((job.limits or {}).get("trials_in_all") or {}).get("applied")) if n]
        self.trials_cap = min(in_all) if in_all else None
        self.spec = spec = TuningSpec.model_validate(job.spec)
        shape = shape_of(spec.model.source, spec.model.dtype)
        self.space = space = SearchSpace(spec, shape)
        hw = spec.hardware      # the host prior holds what a trial process holds before its model, measured here
        baseline = trial_baseline(hw.device, hw.world_size, spec.workload.mode, hw.cpu_threads)
        if offload_root is None:
            offload_root = (Path(artifact_dir).parent if artifact_dir is not None
                            else Path(tempfile.gettempdir())) / "offload"
        self.offload_root = offload_root
        # a previous holder killed mid-trial left its trial's optimizer files: this runner holds the job, so no trial
        # of it runs anywhere else, and the room they took is free again before the disk ceiling is read
        shutil.rmtree(offload_root / job_id, ignore_errors=True)
        on_disk = any(c.uses_disk for c in space.candidates)
        self.state = SearchState(spec, shape, space, baseline=baseline, host_ceiling=default_host_limit,
                                 disk_ceiling=free_bytes(offload_root) if on_disk else None,
                                 rates=self._rates(store, spec))
        self.elapsed_before = float(job.progress.get("elapsed_s", 0.0))
        self.state.seconds_left = lambda: self.spec.search.time_budget_s - self.elapsed()   # no trial predicted past it
        # each config's trial times, search and confirmation apart (a confirmation trial is neither profiled nor
        # timed twice): what its next trial will take
        self.seconds: dict[tuple[Candidate, bool], list[float]] = {}
        self.trial_seconds: list[float] = []    # this run's trials, for the average a trial takes
        self.picks: list[Candidate] = []        # the confirmation round's finalists, once the search has ended
        self.number = 0                         # the next trial's number
        self.room = 1                           # the search's trials at once (search(): slots())
        self.stop: StopReason | None = None     # why the search ended, once it has
        self.confirmation: dict[str, Any] | None = None
        # where the confirmation round runs: the node of its first trial, so that its race is measured on one
        # machine when the executor has several (trials of one node each)
        self.confirm_node: str | None = None

    @staticmethod
    def _rates(store: Store, spec: TuningSpec) -> "MachineRates | None":
        """This machine's rates for the spec's shapes, where `sltune calibrate SPEC` stored them: each trial's step
        is then predicted before it runs (its `predicted`), corrected by the trials before it. None without them:
        the job runs as before (or, under search.step_prior measure, measures them before its first trial)."""
        if spec.search.step_prior == "off":
            return None
        try:
            return stored_rates(store, spec)
        except Exception as err:  # noqa: BLE001 - rates only add a prediction: the job runs without them
            log.warning("the machine's stored rates could not be read (%s); no step-time prior", err)
            return None

    def resume(self) -> None:
        """Read back what earlier runs finished (a trial left running is marked interrupted, to run again), refit on
        it, and bring the Optuna study in line with the store, which is the record."""
        store, job_id, state, spec = self.store, self.job_id, self.state, self.spec
        if self.worker_id is None:
            store.set_status(job_id, "running")
        store.interrupt_running_trials(job_id)          # left running by a previous holder that died
        finished = [t for t in store.trials(job_id) if t.status not in ("running", "interrupted")]
        for t in finished:   # replayed in order: margins widened by past out-of-memory trials come back too
            done = FinishedTrial(t.number, Candidate.from_knobs(t.config), t.role, t.result)
            if t.started_at and t.finished_at and not state.reduced(done):     # what a full-depth trial takes
                self.seconds.setdefault((done.candidate, t.role == "confirm"), []).append(
                    (t.finished_at - t.started_at).total_seconds())
            if t.role == "confirm":
                state.confirms.append(done)         # not search history: they neither refit nor count as tried
            else:
                state.add(done)
        if not finished:
            state.refit()           # fits (empty) exist before the first proposal
        self.number = max((t.number for t in store.trials(job_id)), default=-1) + 1

        self.strategy = STRATEGIES[spec.search.strategy](state, spec.search.seed)
        self.study = study = optuna.create_study(study_name=study_name(job_id),
                                                 storage=optuna_storage(store.url, store.retry_s),
                                                 direction="maximize", load_if_exists=True,
                                                 sampler=self.strategy.sampler())
        name_metric(study)
        # Optuna trials left running by a dead process. The store is the record: a trial it holds as
        # finished (killed between writing the row and telling Optuna) is told its result now.
        by_number = {t.optuna_number: t for t in finished if t.optuna_number is not None}
        for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            row = by_number.get(stale.number)
            if row is not None:
                tell(study, optuna.Trial(study, stale._trial_id), row.result, row.role, row.number,
                     state.depth_of(FinishedTrial(row.number, Candidate.from_knobs(row.config), row.role, row.result)))
            else:
                study.tell(stale.number, state=optuna.trial.TrialState.FAIL)
        add_confirms(study, self.space.params, self.space.distributions(), state.confirms)   # killed before adding them
        self.start = time.monotonic()

    def search(self) -> None:
        """Propose, run an isolated trial, record it, refit, report progress; until the strategy stops, a budget is
        spent, the sampler only repeats itself, or should_stop says so. self.stop says which. With
        hardware.parallel_trials, up to that many trials run at once (on as many nodes), each proposed while the
        others run where the strategy's next choice does not wait on their results (its probes, the grid)."""
        self.report(phase="starting")
        self._calibrate()
        room = self.room = self.slots()
        running: dict[Future, Launched] = {}
        repeats = 0
        with ThreadPoolExecutor(max_workers=room, thread_name_prefix="trial") as pool:
            while True:
                while self.stop is None and len(running) < room:
                    self.stop = self._search_may_not_go_on(len(running))
                    if self.stop is not None:
                        break
                    proposal = self.strategy.propose([(t.candidate, t.layers) for t in running.values()])
                    if proposal is None:
                        break                   # the next choice reads the results of the trials in flight
                    if isinstance(proposal, Stop):
                        if not running:         # else asked again once they have answered
                            self.stop = StopReason(proposal.kind, proposal.reason)
                        break
                    ot, cand = self._ask(proposal, [(t.candidate, t.layers) for t in running.values()])
                    if cand is None:
                        repeats += 1
                        if repeats > MAX_REPEATS:
                            self.stop = StopReason("stuck", "the sampler keeps proposing configs already tried")
                        continue
                    trial = self.launch(cand, proposal.role, ot, proposal.layers)
                    if trial is None:
                        self.study.tell(ot, state=optuna.trial.TrialState.FAIL)
                        break
                    running[pool.submit(self.execute, trial)] = trial
                if not running:
                    return
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in sorted(finished, key=lambda f: running[f].number):
                    trial = running.pop(future)
                    result = self.record(trial, future.result())
                    if result is None:
                        self.study.tell(trial.optuna_trial, state=optuna.trial.TrialState.FAIL)
                        continue
                    done = FinishedTrial(trial.number, trial.candidate, trial.role, result)
                    tell(self.study, trial.optuna_trial, result, trial.role, trial.number, self.state.depth_of(done))
                    self.state.add(done)                # and refit
                    for kind, fit in self.state.fits.items():
                        self.store.save_fit(self.job_id, kind, fit.n, fit.to_dict())
                    self.report(last=self._last(trial, result), phase=trial.role)

    def slots(self) -> int:
        """The trials this job runs at once: hardware.parallel_trials, or as many as the executor's nodes hold,
        saying so in the job's progress when that is fewer."""
        hw = self.spec.hardware
        room = min(hw.parallel_trials, self.executor.slots(hw.nodes, hw.per_node, hw.device))
        if 0 < room < hw.parallel_trials:       # none: each trial fails saying what the nodes lack
            self.report(phase="starting", note=f"hardware.parallel_trials {hw.parallel_trials}: the "
                                               f"{self.executor.name} executor's nodes hold {room} such trials at "
                                               f"once; {room} run at once")
        return max(1, room)

    def confirm(self) -> None:
        """The confirmation round: the finalists run again, a race the beaten drop out of, within the same budgets;
        none when the job was cancelled or released. A budget running out cuts it short, said in self.stop."""
        assert self.stop is not None            # search() has ended, saying why
        if self.stop.kind in ("cancelled", "released"):
            return
        search, state, cap = self.spec.search, self.state, self.trials_cap
        self.picks = confirm.finalists(state) if search.confirm_rounds else []
        while rest := confirm.remaining(state, self.picks, search.confirm_rounds):
            cand = rest[0]
            if cap is not None and len(state.history) + len(state.confirms) >= cap:
                self.stop = self.stop.cut_short(f"this server allows {cap} trials in all, confirmation included "
                                                "(SLTUNE_MAX_TRIALS)")
                break
            left, took = search.time_budget_s - self.elapsed(), confirm.measured_seconds(self.seconds, cand)
            if left <= 0:
                self.stop = self.stop.cut_short(f"time_budget_s ({search.time_budget_s:g}s) used up")
                break
            if took is not None and took > left:    # it would overrun the budget by what is left of its trial
                self.stop = self.stop.cut_short(f"the {left:.0f}s left of time_budget_s ({search.time_budget_s:g}s) "
                                                f"are fewer than a trial of {cand} takes ({took:.0f}s)")
                break
            if why := self._asked_to_stop():
                self.stop = why
                break
            trial = self.launch(cand, "confirm", None, None)
            result = None if trial is None else self.record(trial, self.execute(trial, on=self.confirm_node))
            if result is None:
                break
            if self.confirm_node is None and result.get("nodes") and self.spec.hardware.nodes == 1:
                self.confirm_node = result["nodes"][0]      # the round's every trial on the node of its first
            state.confirms.append(FinishedTrial(trial.number, cand, "confirm", result))
            add_confirms(self.study, self.space.params, self.space.distributions(), state.confirms[-1:])
            self.report(last=self._last(trial, result), phase="confirm")
        self.confirmation = confirm.verdict(state, self.picks)

    def finish(self) -> dict[str, Any]:
        """The job's result. Stored with the job's status (succeeded, failed when no config ran, cancelled), except
        for a released job, handed back unfinished: its progress says so and its holder's worker takes it from
        there (status "released" in the answer only)."""
        stop = self.stop
        assert stop is not None
        out = job_result(self.job_id, self.spec, self.state, stop.text, self.elapsed(), self.confirmation)
        if stop.kind == "released":
            self.store.update_progress(self.job_id, {**self.store.job(self.job_id).progress, "phase": "released",
                                                     "stop_reason": stop.text}, holder=self.worker_id)
            out["status"], out["error"] = "released", None
            return out
        cancelled = stop.kind == "cancelled"
        status = "cancelled" if cancelled else ("succeeded" if out["best"] else "failed")
        error = None if out["best"] or cancelled else ("no config ran successfully: " + self._failures())
        self.report(phase="finished", best=confirm.winner_of(self.state, self.confirmation),
                    figure=out["best"]["tokens_per_s"] if out["best"] else None)
        set_pick(self.study, out)
        self.store.set_status(self.job_id, status, holder=self.worker_id, result=out, error=error)
        out["status"] = status
        out["error"] = error
        return out

    def _failures(self) -> str:
        """The last few trials' failures: why a job without a result has none."""
        errs = [f"{d.candidate}: {d.result['status']} ({d.result.get('error')})" for d in self.state.history[-3:]]
        return "; ".join(errs) or "no trial ran"

    # -- what the steps share ------------------------------------------------------------------------------------

    @property
    def _named(self) -> bool:
        """Whether configs name their backend in progress, SpeedLoader's too: a job of several backends."""
        return len(self.space.backends) > 1

    def elapsed(self) -> float:
        """The job's time so far, this run's and every earlier run's: the time budget is the job's."""
        return self.elapsed_before + time.monotonic() - self.start

    def _asked_to_stop(self) -> StopReason | None:
        return self.should_stop() if self.should_stop else None

    def _search_may_not_go_on(self, running: int = 0) -> StopReason | None:
        """Why no further search trial may start (`running` in flight): a budget spent, or should_stop."""
        search = self.spec.search
        if len(self.state.history) + running >= search.max_trials:
            return StopReason("max_trials", f"max_trials ({search.max_trials}) reached")
        if self.elapsed() >= search.time_budget_s:
            return StopReason("time_budget", f"time_budget_s ({search.time_budget_s:g}s) used up")
        return self._asked_to_stop()

    def _ask(self, proposal: Proposal, pending: list[tuple[Candidate, int | None]]
             ) -> tuple[optuna.Trial, Candidate | None]:
        """The proposal as an Optuna trial (the sampler's choice, or the strategy's enqueued) and its config; None for
        a config that is not a candidate, has run at this depth or runs now (`pending`), its trial told already (a
        repeat, not run)."""
        if proposal.candidate is not None:
            self.study.enqueue_trial(self.space.params(proposal.candidate))
        ot = self.study.ask()
        cand = self.space.suggest(ot)       # define-by-run: a backend's own knobs only (as ask(distributions) alone)
        if cand is None or self.state.ran(cand, proposal.layers) or (cand, proposal.layers) in pending:
            prev = next((d for d in self.state.history
                         if d.candidate == cand and self.state.depth_of(d) == proposal.layers), None)
            if prev is not None and prev.result["status"] == "ok":
                self.study.tell(ot, prev.tokens_per_s)
            else:
                self.study.tell(ot, state=optuna.trial.TrialState.PRUNED)
            return ot, None
        return ot, cand

    def launch(self, cand: Candidate, role: str, ot: optuna.Trial | None, layers: int | None) -> Launched | None:
        """Start a trial's record (of `layers` decoder layers: a probe at reduced depth; None: the whole model) and
        say so in the job's progress: the next trial number is its; None (self.stop set) when the job was taken
        over."""
        self._prepare(cand)            # before its clock: what the next trial takes is the trial's alone
        began = time.monotonic()
        number = self.number
        pred = self.state.predict(cand, layers=layers)
        trace, trace_error = self._trace_file(role, number)
        depth = {"num_layers": layers} if layers is not None else {}
        schedule = self.spec.search.schedule if cand.backend == "speedloader" else None    # as TrialResult.config
        if not self.store.start_trial(self.job_id, number, role, {**cand.knobs(), "schedule": schedule, **depth},
                                      pred.to_dict(), ot.number if ot is not None else None, self.worker_id):
            self.stop = TAKEN_OVER
            return None
        self.number += 1
        self.report(last={"number": number, "config": cand.knobs(self._named), "status": "running"}, phase=role)
        folder = self.offload_root / self.job_id / f"trial-{number}" if cand.writes_files else None
        spec = trial_spec(self.spec, cand, trace, self.default_host_limit, self.max_trial_steps, layers, folder,
                          confirming=role == "confirm", models_dir=confinement())
        return Launched(number, cand, role, layers, ot, spec, folder, trace, trace_error, began, time.monotonic())

    def execute(self, trial: Launched, on: str | None = None) -> dict[str, Any]:
        """The trial in processes of its own (on the node `on` names, where the executor has several); killed if
        should_stop says so while it runs. Touches no store: trials run side by side in threads of their own."""
        folder = trial.folder
        try:
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
            return self.executor.run(trial.spec, stop=self._stop_text if self.should_stop else None,
                                     on=on).model_dump(mode="json")
        finally:
            if folder is not None:       # the optimizer's files are the trial's alone: gone with it
                shutil.rmtree(folder, ignore_errors=True)
                _remove_if_empty(folder.parent)

    def record(self, trial: Launched, result: dict[str, Any]) -> dict[str, Any] | None:
        """A trial's answer stored with its trace; None (self.stop set) when the job was stopped or taken over."""
        trace, trace_error = trial.trace, trial.trace_error
        if trace is not None and result["status"] == "ok" and not trace.exists():
            trace, trace_error = None, f"no trace: it could not be written ({free_space(self.artifact_dir)})"
        if trace_error:
            result["trace_error"] = trace_error
        self.trial_seconds.append(time.monotonic() - trial.started)
        if (why := self._asked_to_stop()) and result["status"] == "failed":
            # killed mid-way: not a result, run it again
            self.store.interrupt_running_trials(self.job_id, self.worker_id)
            self.stop = why
            return None
        if not self.store.finish_trial(self.job_id, trial.number, result, worker_id=self.worker_id):
            self.stop = TAKEN_OVER
            return None
        if trace is not None and trace.exists():
            try:
                self.store.add_artifact(self.job_id, trial.number, "trace",
                                        str(trace.relative_to(self.artifact_dir)), trace.stat().st_size)
            except Exception as err:  # noqa: BLE001 - the trial's result is stored; only its trace is lost
                log.warning("job %s trial %d: its trace could not be recorded (%s)", self.job_id, trial.number, err)
        if trial.layers is None:
            self.seconds.setdefault((trial.candidate, trial.role == "confirm"), []).append(
                time.monotonic() - trial.began)
        return result

    def _calibrate(self) -> None:
        """search.step_prior measure: the rates the store lacks for the spec's shapes, measured before the first trial
        as `sltune calibrate SPEC` measures them (and stored, for the next job), in at most CALIBRATE_S or a tenth of
        the time budget, which they count against. A calibration that fails leaves the job on its probes' fits, its
        progress saying why."""
        if self.spec.search.step_prior != "measure" or self.state.rates is not None or self.state.history:
            return
        budget = min(CALIBRATE_S, self.spec.search.time_budget_s / 10)
        self.report(phase="calibrating", note=f"measuring this machine's rates for the step-time prior (about "
                                              f"{budget:.0f}s, once per machine and model shape)")
        try:
            self.offload_root.mkdir(parents=True, exist_ok=True)
            rates, _ = calibrated(self.store, self.spec, self.offload_root, budget_s=budget,
                                  progress=lambda what: self.report(phase="calibrating", note=f"calibrate: {what}"))
        except Exception as err:  # noqa: BLE001 - the rates only guide the search: it goes on without them
            log.warning("job %s: calibration failed (%s: %s); no step-time prior", self.job_id,
                        type(err).__name__, err)
            self.report(phase="calibrating", note=f"calibration failed ({type(err).__name__}: {err}); the search "
                                                  "goes on from its probes' fits")
            return
        self.state.use_rates(rates)

    def _prepare(self, cand: Candidate) -> None:
        """DeepSpeed's compiled ops, built once before its first trial if the install left them out
        (sltune.backends.deepspeed_ops), saying so in the job's progress; within the job's time budget, which the
        build counts against. A build that fails leaves the reason for run_trial, which answers each DeepSpeed trial
        with it (naming the install) without starting it."""
        if cand.backend != "deepspeed":
            return
        accelerator = deepspeed_ops.accelerator_of(self.spec.hardware.device)
        ops = deepspeed_ops.needed(accelerator, cand.offload_optimizer, cand.offload_param, self.spec.optimizer.name)
        if deepspeed_ops.missing(ops, accelerator):
            deepspeed_ops.prepare(ops, accelerator, say=lambda line: self.report(phase="preparing", note=line),
                                  timeout_s=self.spec.search.time_budget_s - self.elapsed())

    def _trace_file(self, role: str, number: int) -> tuple[Path | None, str | None]:
        """Where the next trial writes its profile (search.profile: search trials only), or why it writes none."""
        if not (self.spec.search.profile and self.artifact_dir is not None and role != "confirm"):
            return None, None
        trace = Path(self.artifact_dir) / self.job_id / f"trial-{number}.json"
        try:
            trace.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:          # a full disk costs the trial its trace, nothing more
            return None, f"no trace: its folder could not be made ({err.strerror})"
        return trace, None

    def _stop_text(self) -> str | None:
        """should_stop as run_trial polls it: the reason's words, which a killed trial's error quotes."""
        why = self._asked_to_stop()
        return why.text if why else None

    def report(self, last: dict[str, Any] | None = None, phase: str = "running", best: FinishedTrial | None = None,
               figure: float | None = None, note: str | None = None) -> None:
        """Store the job's progress and pass it to the progress callback; `note`: a line of what the job is doing
        between trials (building DeepSpeed's ops)."""
        state, search, picks = self.state, self.spec.search, self.picks
        best = best or state.best()         # finished: the confirmed winner and its figure, as the result names
        done = len(state.history)
        avg = sum(self.trial_seconds) / len(self.trial_seconds) if self.trial_seconds else None
        # the confirmation trials that will still run: as many as the server's cap on trials in all leaves (a
        # capped job said 40 planned where none could run); finished, none (what ran is all there is)
        rest = confirm.remaining(state, picks, search.confirm_rounds) if phase == "confirm" else None
        if rest and self.trials_cap is not None:
            rest = rest[:max(0, self.trials_cap - len(state.history) - len(state.confirms))]
        if phase == "finished":
            rest = []
        left = confirm.time_left(state, search, self.elapsed(), rest, self.seconds, avg, self.trials_cap, self.room)
        if phase == "finished":
            left = 0.0
        payload = {"trials_done": done, "max_trials": search.max_trials, "confirm_done": len(state.confirms),
                   "confirm_planned": len(state.confirms) + len(rest) if rest is not None and len(picks) > 1 else None,
                   "elapsed_s": round(self.elapsed(), 2),
                   "time_left_s": max(0.0, round(left, 1)), "phase": phase,
                   "stop_reason": self.stop.text if self.stop else None,
                   "best_tokens_per_s": figure if figure is not None else best.tokens_per_s if best else None,
                   "best_config": best.candidate.knobs(self._named) if best else None, "last_trial": last,
                   **({"note": note} if note else {})}
        self.store.update_progress(self.job_id, payload, holder=self.worker_id)
        if self.progress:
            self.progress(payload)

    def _last(self, trial: Launched, result: dict[str, Any]) -> dict[str, Any]:
        """A finished trial as progress shows it."""
        return {"number": trial.number, "config": trial.candidate.knobs(self._named), "status": result["status"],
                "tokens_per_s": result.get("tokens_per_s"), "error": result.get("error")}


def free_space(folder: Path | None) -> str:
    """The data directory's free space, in words: why a trial's trace could not be written."""
    try:
        return f"{format_bytes(shutil.disk_usage(folder).free)} free in the data directory"
    except (OSError, TypeError):
        return "the data directory cannot be read"


def _remove_if_empty(folder: Path) -> None:
    """The job's offload folder, once its trial's folder is gone: a finished job leaves nothing there."""
    try:
        folder.rmdir()
    except OSError:
        pass
