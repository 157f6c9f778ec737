"""The smallest tuning spec, which a job runs in seconds: one source for every test that tunes or submits one;
and `parse`, a spec of llama-tiny with the given sections, parsed and admitted as tune, plan and POST /tune admit it."""

from __future__ import annotations


def tiny_spec(name: str = "job", trials: int = 3, **search) -> dict:
    return {"name": name, "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
            "hardware": {"device_memory_limit": "3MiB"},
            "search": {"sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2], "num_live_blocks": [1, 2],
                       "max_trials": trials, "trial_steps": 1, "trial_min_time_s": 0, "confirm_rounds": 0,
                       "profile": False, **search}}


def admitted_spec(data):
    """A spec (its data or file) parsed and admitted, as tune, plan and POST /tune admit it: the TuningSpec."""
    from sltune.tuning.cost.admission import load

    return load(data).spec


BASE = {"name": "t", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32}}


def parse(**overrides):
    data = {**BASE, **overrides}
    return admitted_spec(data)
