"""run_trial's stand-in for tests of what a job does with its measurements: each config's figures are set
by the test, not by the machine, so a claim about them holds by construction on a busy machine too."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from sltune.profiling.schema import TrialResult
from sltune.profiling.timing import summarize

QUIET = {"wall_s": 1.0, "process_cpu_s": 1.0, "threads": 1, "cores": 2, "process_cpu_share": 1.0,
         "machine_busy": 0.5, "others_busy_cores": 0.0, "loadavg_1m": 0.1, "device_processes": None}


class FakeTrials:
    """Config b measures speed[b] tokens/s at its first trial and `later[r]` times that at its r-th later one
    (the machine got faster mid-job: the confirmation round re-measures the pick at other figures than its
    search trial; a dict gives each b its own, 1.0 for a b it lacks), 20 steps with 2% lognormal noise, seeded; each
    trial takes wall[b] seconds (default 0).
    Monkeypatch it over sltune.executors.local.run_trial (what a job's local executor runs)."""

    def __init__(self, speed: dict[int, float], later: tuple[float, ...] | dict[int, tuple[float, ...]] = (1.0,),
                 wall: dict[int, float] | None = None):
        self.speed, self.later, self.wall = speed, later, wall or {}
        self.calls: Counter = Counter()
        self.specs: list = []

    def __call__(self, spec, stop=None) -> TrialResult:
        b = spec.sub_batch_size
        r = self.calls[b]
        self.calls[b] += 1
        self.specs.append(spec)
        later = self.later.get(b, (1.0,)) if isinstance(self.later, dict) else self.later
        tps = self.speed[b] * (1.0 if r == 0 else later[min(r - 1, len(later) - 1)])
        tokens = spec.sub_batch_size * spec.num_sub_batches * spec.seq_len
        rng = np.random.default_rng(len(self.specs))
        steps = (tokens / tps * rng.lognormal(0.0, 0.02, 20)).tolist()
        time.sleep(self.wall.get(b, 0.0))
        timing = summarize(steps, [tokens] * len(steps), dict(QUIET))
        return TrialResult.model_validate({
            "status": "ok", "tokens_per_s": timing["tokens_per_s"], "step_seconds": timing["median_s"],
            "timing": timing, "peak_device_bytes": 10**6 * b, "peak_host_bytes": 10**8 + r,
            "config": {"sub_batch_size": b, "num_sub_batches": spec.num_sub_batches,
                       "num_live_blocks": spec.num_live_blocks, "schedule": spec.schedule, "seq_len": spec.seq_len}})
