"""A whole tuning job run in this process (`sltune tune`, scripts, benchmarks), held as a worker holds one.

It lives with the workers, not in sltune.tuning: holding a job (its lease, heartbeat and hand-back) is the
service's business, and the tuning layer below it knows nothing of workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sltune.service.worker import Worker
from sltune.settings import Settings
from sltune.store import Store
from sltune.tuning.cost.admission import Admitted, admitted
from sltune.tuning.runner import ProgressFn, requirements
from sltune.tuning.spec import TuningSpec


def tune(spec: Admitted | TuningSpec | dict[str, Any] | str | Path, db: str | None = None, *,
         strategy: str | None = None, job_id: str | None = None, progress: ProgressFn | None = None,
         settings: Settings | None = None, oversubscribe: bool = False) -> dict[str, Any]:
    """A whole tuning job in this process: create it (or resume the unfinished one with the same spec).

    The process holds the job as a worker would: claimed atomically, with a lease its heartbeat renews, so
    a server worker on the same database never runs it at the same time, and takes it over if this
    process dies. `oversubscribe` runs more ranks than this machine has cores (refused otherwise). A spec
    already admitted (sltune.tuning.cost.admission) runs as it is: its caller has checked it against this machine
    (fits_this_machine), as `sltune tune` does before its progress bar starts."""
    settings = settings or Settings()
    if db:
        settings = settings.model_copy(update={"db": db})
    if not isinstance(spec, Admitted):
        source = str(spec) if isinstance(spec, (str, Path)) else "spec"
        if isinstance(spec, (str, Path)):
            spec = TuningSpec.load(spec)
        elif isinstance(spec, dict):
            spec = TuningSpec.parse(spec)
        if strategy is not None:
            spec = TuningSpec.model_validate({**spec.model_dump(), "search": {**spec.search.model_dump(),
                                                                              "strategy": strategy}})
        fits_this_machine(admitted(spec, source), settings, oversubscribe)
    else:
        spec = spec.spec
    store = Store(settings.db_url())
    job = store.job(job_id) if job_id else store.resumable(spec.digest())
    if job is None:
        job = store.create_job(spec.name, spec.model_dump(mode="json"), spec.digest(), requirements(spec),
                               job_id=job_id)
    worker = Worker(settings, worker_id=f"cli:{Worker.default_id()}")
    held = store.job(job.id)
    claimed = store.claim_job(job.id, worker.id, settings.lease_seconds) or (
        Worker.is_dead_here(held.worker_id) and store.take_over(job.id, held.worker_id, worker.id,
                                                                settings.lease_seconds))
    if not claimed:
        held = store.job(job.id)
        raise ValueError(f"job {job.id} is {held.status}"
                         + (f" on {held.worker_id} (lease until {held.lease_expires_at:%H:%M:%S} UTC); wait for it, "
                            f"cancel it, or give this run another --job-id" if held.status == "running" else ""))
    try:
        return worker.run(job.id, progress=progress, reraise=True)
    except KeyboardInterrupt:
        # interrupted here: hand the job back at once (queued), for a re-run or a server worker to resume
        store.interrupt_running_trials(job.id, worker.id)
        store.set_status(job.id, "queued", holder=worker.id, worker_id=None, lease_expires_at=None)
        raise


def fits_this_machine(ok: Admitted, settings: Settings, oversubscribe: bool = False) -> None:
    """Refuse, before any trial, a Ray cluster that does not answer (hardware.executor ray), ranks beyond this
    machine's cores (the server's ceiling on hardware.world_size, unless `oversubscribe`; on a Ray cluster its
    executor's), and a spec whose least config is predicted over a limit (sltune.tuning.cost.feasible): the spec's
    host limit, or without one this machine's trial ceiling (a 70B spec's trials would each grow to it and
    be killed), for all the trial's ranks together; and its device limit. The host prior counts what a trial
    process holds before its model, measured on this machine (once: sltune.tuning.cost.baseline)."""
    from sltune.tuning.cost.baseline import trial_baseline
    from sltune.tuning.cost.feasible import disk_room, shortfall
    from sltune.tuning.search.trials import ranks_fit

    spec, space = ok.spec, ok.space
    hw = spec.hardware
    if hw.executor == "ray":        # the cluster answers (a node's CPUs bound the ranks: its executor says so)
        from sltune.executors.on_ray import reachable

        reachable(settings.ray_address)
    elif not oversubscribe:
        ranks_fit(hw.world_size, settings.world_size_ceiling, "hardware.world_size", "--oversubscribe")
    recipe = ok.with_baseline(trial_baseline(hw.device, hw.world_size, spec.workload.mode, hw.cpu_threads))
    unset = hw.host_memory_limit is None
    # the files go in the data directory: no more than it has free, for the spec's disk configs and for those a
    # refusal names as what would fit
    disk_limit, disk_name = disk_room(hw.disk_limit, settings.offload_root())
    short = shortfall(recipe, space.candidates,
                      settings.trial_host_limit() if unset else hw.host_memory_limit, hw.device_memory_limit,
                      host_name="the ceiling" if unset else "hardware.host_memory_limit",
                      disk_limit=disk_limit, disk_name=disk_name)
    if short:
        raise ValueError((f"hardware.host_memory_limit is not set, so {settings.trial_host_limit_source()} is the "
                          f"limit: " if unset and "the ceiling" in short else "") + short)
