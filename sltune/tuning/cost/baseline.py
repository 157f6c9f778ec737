"""What a trial process holds before its model's own bytes: measured on this machine, not guessed.

A trial is a process forked from a server that has imported python, torch and transformers; building its model
and running a step then brings torch's own lazy state (thread pools, the autograd engine, the optimizer's
kernels). On this machine that came to about 0.35 GiB, the whole host peak of a tiny model's trial. It is
measured the way trials measure themselves: one trial of a micro model (one layer, hidden 16), its peak host
bytes less the micro model's own prior terms (about a second once the fork server is up). The figure depends on
the device, the ranks, the mode, the threads and the library versions; the last one measured is kept per those
in the user's cache for the commands that run no trial.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
from pathlib import Path

MICRO = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0}
_MEMO: dict[str, int] = {}


def trial_baseline(device: str = "cpu", world_size: int = 1, mode: str = "train", cpu_threads: int | None = None,
                   measure: bool = True) -> int:
    """Bytes of host memory a trial holds beyond its model's terms (all its ranks together).

    Measured by a trial from this process's own fork server (`measure`: where this process runs trials, tune and
    profile): its figure moves by some 10% between processes that start their fork servers differently (a test
    runner's measured 0.33 GiB where a script's measured 0.36), so it is measured once per process, not read from
    elsewhere. Without `measure` (plan, the server's spec checks), the last figure measured on this machine for
    the setting, else this process's own resident memory (an idle process of the same imports)."""
    key = _key(device, world_size, mode, cpu_threads)
    if key in _MEMO:
        return _MEMO[key]
    if not measure or multiprocessing.current_process().daemon:      # a daemonic process may start no trial
        cached = _read_cache().get(key)
        if isinstance(cached, int) and cached > 0:
            return cached
        from sltune.profiling import forks

        # an idle process of the trials' imports (this one may have none of them)
        return forks.call("sltune.profiling.resident:resident_bytes") * max(1, world_size)
    _MEMO[key] = measured = _measure(device, world_size, mode, cpu_threads)
    _write_cache(key, measured)
    return measured


def _measure(device: str, world_size: int, mode: str, cpu_threads: int | None) -> int:
    from sltune.profiling import run_trial
    from sltune.profiling.schema import TrialSpec
    from sltune.tuning.cost.prior import predict
    from sltune.tuning.cost.setup import Setup
    from sltune.tuning.cost.shape import shape_of
    from sltune.tuning.space import Candidate

    trial = TrialSpec(model=MICRO, mode=mode, seq_len=4, prompt_len=2, new_tokens=2, world_size=world_size,
                      device=device, cpu_threads=cpu_threads, steps=1, min_time_s=0.0, max_steps=1, remeasure=0,
                      profile=False, timeout_s=120.0)
    result = run_trial(trial)
    if result.status != "ok" or not result.peak_host_bytes:
        raise RuntimeError(f"measuring what a trial process holds failed: {result.status}: {result.error}")
    own = predict(Setup.of_trial(trial, shape_of(MICRO, trial.dtype)), Candidate(1, 1, 1)).host
    return max(int(result.peak_host_bytes) - own, 1)


def _key(device: str, world_size: int, mode: str, cpu_threads: int | None) -> str:
    """The setting and the library versions the figure depends on (read from their installs: no import of torch)."""
    from importlib.metadata import version

    from sltune import __version__

    return "|".join(str(x) for x in (device, world_size, mode, cpu_threads, os.cpu_count(), platform.python_version(),
                                     version("torch"), version("transformers"), __version__))


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sltune" / "trial-baseline.json"


def _read_cache() -> dict[str, int]:
    try:
        data = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, value: int) -> None:
    """Best effort: a machine whose home cannot be written measures again in each process."""
    try:
        path = _cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**_read_cache(), key: value}, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass
