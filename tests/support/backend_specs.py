"""The spec, search space, candidates and finished trials the tests of tuning over backends share
(search.backend: speedloader, deepspeed, fsdp)."""

from sltune.tuning.cost.shape import shape_of
from sltune.tuning.search.state import FinishedTrial, SearchState
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec

SHAPE = shape_of("llama-tiny")
KNOBS = {"sub_batch_size": [1, 2], "num_sub_batches": [1, 2], "num_live_blocks": [1, 2]}


def parse(search: dict | None = None, **sections) -> TuningSpec:
    return TuningSpec.parse({"model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32}, **sections,
                             "search": search or {}})


def space(**search) -> SearchSpace:
    return SearchSpace(parse(search), SHAPE)


def ds(b: int, n: int, stage: int = 2, opt: str = "none", param: str = "none") -> Candidate:
    return Candidate(b, n, None, backend="deepspeed", zero_stage=stage, offload_optimizer=opt, offload_param=param)


def fsdp(b: int, n: int, cpu: bool = False) -> Candidate:
    return Candidate(b, n, None, backend="fsdp", cpu_offload=cpu, reshard_after_forward=True)


def ok(number: int, c: Candidate, tps: float, status: str = "ok") -> FinishedTrial:
    return FinishedTrial(number, c, "grid", {
        "status": status, "tokens_per_s": tps, "step_seconds": c.batch * 32 / tps,
        "peak_device_bytes": 10**6 * c.sub_batch_size, "peak_host_bytes": 10**8 + c.sub_batch_size,
        **({"error": "step-1 loss 2 is not plain PyTorch's 1"} if status != "ok" else {}),
        "timing": {"steps_s": [c.batch * 32 / tps] * 5, "median_s": c.batch * 32 / tps,
                   "tokens_per_s_ci95": [0.99 * tps, 1.01 * tps]}})


def state_of(**search) -> SearchState:
    spec = parse({**KNOBS, **search})
    return SearchState(spec, SHAPE, SearchSpace(spec, SHAPE))
