"""What one trial of a job runs: a candidate of the spec as an isolated trial's TrialSpec, under the worker's
ceilings (host memory, steps, this machine's cores)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sltune.profiling.schema import TrialSpec
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate
from sltune.tuning.spec import TuningSpec


def machine_cores() -> int:
    """The cores this process may run on (its affinity), which its trials share."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        return os.cpu_count() or 1


def ranks_fit(world_size: int, ceiling: int, field: str, allow: str) -> None:
    """Refuse ranks beyond this machine's cores before any trial, naming `field`: a trial's ranks are processes here,
    and more of them than cores take turns on the cores, so what they measure is the oversubscription, not the
    config (8 ranks of an FSDP tune on 2 cores ran, and best.yaml said world_size 8). `allow`, the flag that
    measures it anyway, goes in the answer; `ceiling` is the server's setting (SLTUNE_MAX_WORLD_SIZE, else the
    cores)."""
    if world_size > ceiling:
        raise ValueError(f"{field} {world_size} is more ranks than this machine's {ceiling} (SLTUNE_MAX_WORLD_SIZE, "
                         f"else its cores): they would take turns on the cores, and the trials would measure that; ask "
                         f"for at most {ceiling}, or pass {allow} to oversubscribe on purpose")


def trial_spec(spec: TuningSpec, c: Candidate, trace: Path | None, default_host_limit: int | None = None,
               max_trial_steps: int | None = None, layers: int | None = None,
               offload_dir: Path | None = None, confirming: bool = False,
               models_dir: Path | None = None) -> TrialSpec:
    """What one trial runs. The worker's ceilings hold whatever the stored spec says: host memory; timed steps, every
    round together (an unstable round is re-measured only while both fit); and intra-op threads, at most this machine's
    cores shared by the ranks (more would only take turns on them). A probe at reduced depth (`layers`) times its steps
    for that share of trial_min_time_s: as many steps as the whole model's would. A config of optimizer_offload disk
    writes its files in `offload_dir`, the runner's folder for the trial (never a path from the spec), and so does one
    of param_offload disk (its weights' files). A confirmation trial (`confirming`) only times its steps, once: its
    config's breakdown and trace are its search trial's, and the paired rounds are its re-measurement (a round of its
    own measured again would pick the quieter of two moments for one finalist and not for the others); it cost a search
    trial's time again under load (bench/tuner.py). A config of another backend runs it with its knobs (DeepSpeed's nvme
    offload swaps to files in `offload_dir` too); SpeedLoader's fields keep the defaults that backend runs. A job a
    server admitted reads its model folder only inside `models_dir` (sltune.models.confined), in the trial too."""
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
        threads = min(threads, max(1, machine_cores() // hw.per_node))
    speedloader = c.backend == "speedloader"
    files: dict[str, Any] = {}
    if speedloader and ((c.on_disk and w.mode == "train") or c.weights_on_disk):
        what = "param_offload disk" if c.weights_on_disk else "optimizer_offload disk"
        files = {"offload_dir": str(_required(offload_dir, what)),
                 **({"optimizer_offload": "disk"} if c.on_disk and w.mode == "train" else {}),
                 **({"param_offload": "disk"} if c.weights_on_disk else {})}
    elif c.writes_files:
        which = "offload_optimizer" if c.offload_optimizer == "nvme" else "offload_param"
        files = {"offload_dir": str(_required(offload_dir, f"search.deepspeed.{which} nvme"))}
    return TrialSpec(model=spec.model.source, dtype=spec.model.dtype, mixed_precision=spec.model.mixed_precision,
                     optimizer=spec.optimizer, sub_batch_size=c.sub_batch_size, num_sub_batches=c.num_sub_batches,
                     num_live_blocks=c.num_live_blocks if speedloader else 1,
                     schedule=s.schedule if speedloader else "speedloader",
                     activations=c.activations, mode=w.mode, backend=c.backend, **c.backend_knobs(),
                     kv_cache=c.kv_cache or "host", weights_on_device=c.weights_on_device or 0.0, seq_len=w.seq_len,
                     prompt_len=w.prompt_len, new_tokens=w.new_tokens, world_size=hw.world_size, nodes=hw.nodes,
                     device=hw.device,
                     device_memory_limit=hw.device_memory_limit,
                     host_memory_limit=min((x for x in (hw.host_memory_limit, default_host_limit) if x),
                                           default=None),
                     steps=steps, min_time_s=min_time, max_steps=max_steps, remeasure=remeasure, cpu_threads=threads,
                     profile=s.profile and not confirming, trace_path=str(trace) if trace else None,
                     timeout_s=s.trial_timeout_s, seed=s.seed, num_layers=layers,
                     models_dir=str(models_dir) if models_dir is not None else None, **files)


def _required(offload_dir: Path | None, what: str) -> Path:
    if offload_dir is None:
        raise ValueError(f"a config of {what} needs the runner's offload folder for its trial (offload_dir); the "
                         "runner gives each such trial one under its data directory")
    return offload_dir
