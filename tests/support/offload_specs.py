"""The specs and candidates the tests of tuning with the optimizer and the weights on disk share
(search.optimizer_offload, search.param_offload), down to llama-2-7b under 17 GiB of host memory."""

from __future__ import annotations

from sltune.tuning.cost import feasible
from sltune.tuning.report import plan_from_prior
from sltune.tuning.space import Candidate
from sltune.tuning.spec import TuningSpec

GiB = 2**30
TINY = {"name": "t", "model": {"preset": "llama-tiny", "dtype": "bfloat16"}, "workload": {"seq_len": 32}}
BOTH = {"optimizer_offload": ["host", "disk"], "param_offload": ["host", "disk"]}
# llama-2-7b in bfloat16, mixed precision, AdamW: the goal is a plan under 17 GiB of host memory
SEVEN_B = {"name": "7b", "model": {"preset": "llama-2-7b", "dtype": "bfloat16"}, "workload": {"seq_len": 128},
           "search": {"sub_batch_size": [1], "num_sub_batches": [1], "num_live_blocks": [1]}}
HOST = Candidate(1, 1, 1)
OPTIMIZER = Candidate(1, 1, 1, optimizer_offload="disk")
WEIGHTS = Candidate(1, 1, 1, optimizer_offload="disk", param_offload="disk")


def spec(search: dict | None = None, **sections) -> TuningSpec:
    base = {**TINY, **sections}
    return TuningSpec.parse({**base, "search": {"sub_batch_size": [1, 2], "num_sub_batches": [1, 2],
                                                "num_live_blocks": [1], **(search or {})}})


def seven_b(free: int, monkeypatch, **search) -> dict:
    """The 7B spec planned with `free` bytes free where trials offload to, and a trial process's own bytes pinned
    at 0.35 GiB: plan reads the last figure measured here, else this process's resident memory (a test process's
    grows with the tests it has run: the refusal's minimum read 117.0 GiB after some, 116.x after others)."""
    monkeypatch.setattr(feasible, "free_bytes", lambda folder: free)
    monkeypatch.setattr(plan_from_prior, "trial_baseline", lambda *args, **kwargs: int(0.35 * GiB))
    return {**SEVEN_B, "search": {**SEVEN_B["search"], **search}}
