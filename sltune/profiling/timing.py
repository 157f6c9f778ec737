"""Timing a trial the way a benchmark tool does: calibrated step counts, every step kept, interference
observed, unstable rounds measured again.

After the warm-ups, steps run until they add up to `min_time_s` of measured time (at least `steps`, at most
`max_steps`, whichever binds), like pyperf's calibration: a fast config gets many steps, a slow one few.
While they run, the process's CPU time and the machine's CPU time are sampled, so the result says how
much of the machine other processes were using (interference is observed, not guessed). A round whose
spread (coefficient of variation) or interference is over a threshold is marked unstable and measured
again, up to `remeasure` more rounds; the steadiest round is reported, its `rounds` count with it.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np
import psutil

from sltune.profiling import stats

CV_LIMIT = 0.10             # spread above which one step's time says little about the next
OTHERS_LIMIT = 0.5          # cores' worth of other processes' work that makes a round unstable when they
                            # cannot run beside the trial's threads without taking cores from it


class _Window:
    """Process and machine CPU time over one timed round."""

    def __init__(self) -> None:
        self.wall = time.monotonic()
        self.proc = time.process_time()
        self.machine = psutil.cpu_times()
        self.load = _loadavg()

    def close(self, threads: int) -> dict[str, Any]:
        wall = max(time.monotonic() - self.wall, 1e-9)
        proc = time.process_time() - self.proc
        now = psutil.cpu_times()
        total = sum(now) - sum(self.machine)
        idle = (now.idle + getattr(now, "iowait", 0.0)) - (self.machine.idle + getattr(self.machine, "iowait", 0.0))
        cores = psutil.cpu_count() or 1
        busy = max(0.0, min(1.0, 1.0 - idle / total)) if total > 0 else 0.0
        others = max(0.0, busy * cores - proc / wall)
        return {"wall_s": wall, "process_cpu_s": proc, "threads": threads, "cores": cores,
                "process_cpu_share": proc / (wall * threads),
                "machine_busy": busy, "others_busy_cores": others,
                "loadavg_1m": _loadavg(), "device_processes": _other_device_processes()}


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _other_device_processes() -> int | None:
    """Other processes on this trial's GPU (CUDA with pynvml only); None where it cannot be seen."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return sum(1 for p in procs if p.pid != os.getpid())
    except Exception:  # noqa: BLE001 - no NVML: unknown, not zero
        return None


def unstable_because(cv: float | None, interference: dict[str, Any]) -> list[str]:
    why = []
    if cv is not None and cv > CV_LIMIT:
        why.append(f"step times vary by {cv:.0%} (cv > {CV_LIMIT:.0%})")
    others = interference["others_busy_cores"]
    if others > OTHERS_LIMIT and others + interference["threads"] > interference["cores"]:
        why.append(f"other processes used {others:.1f} of {interference['cores']} cores beside the trial's "
                   f"{interference['threads']} threads")
    if interference.get("device_processes"):
        why.append(f"{interference['device_processes']} other processes on the device")
    return why


def summarize(seconds: list[float], tokens: list[int], interference: dict[str, Any]) -> dict[str, Any]:
    """TrialResult.timing for one round of timed steps."""
    tps = [t / s for t, s in zip(tokens, seconds)]
    spread = stats.cv(seconds)
    why = unstable_because(spread, interference)
    return {"steps_s": seconds, "median_s": float(np.median(seconds)), "tokens_per_step": float(np.median(tokens)),
            "tokens_per_s": float(np.median(tps)), "tokens_per_s_ci95": list(stats.median_ci(tps)),
            "cv": spread, "unstable": bool(why), "unstable_reasons": why, "interference": interference}


def _agree(go_on: bool) -> bool:
    """Every rank of a multi-rank trial takes the same branch: each step is collective, so a rank that stopped
    on its own clock would leave the others waiting on a peer that has gone. Go on while any rank would."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return go_on
    flag = torch.tensor([int(go_on)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def measure(step: Callable[[], tuple[float, int]], steps: int, min_time_s: float, max_steps: int,
            remeasure: int) -> dict[str, Any]:
    """Run calibrated rounds of `step` (which returns its seconds and tokens); the steadiest round's
    timing, with how many rounds it took."""
    import torch

    rounds = []
    for _ in range(1 + remeasure):
        window = _Window()
        seconds: list[float] = []
        tokens: list[int] = []
        while _agree(len(seconds) < steps or (sum(seconds) < min_time_s and len(seconds) < max_steps)):
            s, t = step()
            seconds.append(s)
            tokens.append(t)
        rounds.append(summarize(seconds, tokens, window.close(torch.get_num_threads())))
        if not _agree(rounds[-1]["unstable"]):
            break
    best = min(rounds, key=lambda r: (r["unstable"], r["interference"]["others_busy_cores"], r["cv"] or 0.0))
    return {**best, "rounds": len(rounds)}


def timing_of(result: dict[str, Any] | None) -> dict[str, Any]:
    """A TrialResult's (as a dict) `timing`: {} for a result without one (failed, or from before timing)."""
    return (result or {}).get("timing") or {}


def step_tokens_per_s(result: dict[str, Any]) -> list[float] | None:
    """Tokens/s of every timed step of an ok TrialResult (as a dict); a result from before step times were
    kept gives its one figure; None when it has none."""
    if result.get("status") != "ok" or not result.get("tokens_per_s"):
        return None
    timing = timing_of(result)
    if not timing.get("steps_s"):
        return [result["tokens_per_s"]]
    tokens = timing.get("tokens_per_step") or result["tokens_per_s"] * timing["median_s"]
    return [tokens / s for s in timing["steps_s"]]
