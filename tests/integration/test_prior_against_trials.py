"""The prior, which sees no trial, within 10% of what one real trial per case measures."""

import pytest

from sltune.profiling import run_trial
from sltune.profiling.schema import TrialSpec
from sltune.tuning.cost.baseline import trial_baseline
from sltune.tuning.cost.prior import predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate
from tests.support.deepspeed import needs_deepspeed

SGD = {"name": "sgd", "momentum": 0.9}
# every precision and both optimizers on each model, training; and generation with its KV caches on either side
CASES = {
    "tiny-fp32-adamw": dict(model="llama-tiny"),
    "tiny-bf16-mixed-sgd": dict(model="llama-tiny", dtype="bfloat16", optimizer=SGD),
    "tiny-bf16-pure-adamw": dict(model="llama-tiny", dtype="bfloat16", mixed_precision=False),
    "small-fp32-sgd": dict(model="llama-small", optimizer={"name": "sgd"}, num_live_blocks=2),
    "small-bf16-mixed-adamw": dict(model="llama-small", dtype="bfloat16"),
    "small-bf16-pure-sgd": dict(model="llama-small", dtype="bfloat16", mixed_precision=False, optimizer=SGD,
                                sub_batch_size=4, num_sub_batches=1),
    # the optimizer and the weights on disk: the windows instead of the model (sltune.runtime.disk: weightfiles,
    # gradwindow)
    "small-bf16-mixed-adamw-on-disk": dict(model="llama-small", dtype="bfloat16", optimizer_offload="disk",
                                           param_offload="disk"),
    "tiny-generate": dict(model="llama-tiny", mode="generate", prompt_len=16, new_tokens=4),
    "small-generate-device-kv": dict(model="llama-small", mode="generate", prompt_len=16, new_tokens=4,
                                     kv_cache="device", dtype="bfloat16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_prior_is_within_ten_percent_of_what_a_trial_measures(case, tmp_path):
    """One real trial per case, measured as every trial is (its resident peak, the runtime's device tracker);
    the prior, which saw no trial, within 10% of both."""
    disk = {"offload_dir": str(tmp_path)} if CASES[case].get("optimizer_offload") == "disk" else {}
    spec = TrialSpec(**{"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": 1, "seq_len": 32, "steps": 1,
                        "min_time_s": 0.0, "max_steps": 1, "remeasure": 0, "profile": False, **CASES[case], **disk})
    generate = spec.mode == "generate"
    config = Candidate(spec.sub_batch_size, spec.num_sub_batches, spec.num_live_blocks, spec.activations,
                       spec.kv_cache if generate else None, spec.weights_on_device if generate else None,
                       optimizer_offload=spec.optimizer_offload, param_offload=spec.param_offload)
    baseline = trial_baseline(spec.device, spec.world_size, spec.mode, spec.cpu_threads)
    prior = predict(Setup.of_trial(spec, shape_of(spec.model, spec.dtype), baseline), config)
    result = run_trial(spec)
    assert result.status == "ok", result.error
    assert prior.host == pytest.approx(result.peak_host_bytes, rel=0.10), (prior.host_terms, result.peak_host_bytes)
    assert prior.device == pytest.approx(result.peak_device_bytes, rel=0.10), (prior.device_terms,
                                                                             result.peak_device_bytes)


# the wrapped backends on llama-small in bfloat16 with float32 masters, as a user tunes them: each issue #49 saw run
# out of memory at full scale (ZeRO-2 and FSDP2 with their optimizers offloaded), the ZeRO-3 that ran, and the two
# without offload
WRAPPED = [
    pytest.param(dict(backend="deepspeed", zero_stage=2, offload_optimizer="cpu"), id="zero2-offload-optimizer",
                 marks=needs_deepspeed),
    pytest.param(dict(backend="deepspeed", zero_stage=3), id="zero3", marks=needs_deepspeed),
    pytest.param(dict(backend="deepspeed", zero_stage=3, offload_optimizer="cpu", offload_param="cpu"),
                 id="zero3-offload-both", marks=needs_deepspeed),
    pytest.param(dict(backend="fsdp"), id="fsdp"),
    pytest.param(dict(backend="fsdp", cpu_offload=True), id="fsdp-cpu-offload"),
]


@pytest.mark.parametrize("knobs", WRAPPED)
def test_a_wrapped_backend_s_device_prior_is_within_ten_percent_of_its_trial(knobs):
    """The device peak a DeepSpeed or FSDP2 trial measures (its first two steps: the second holds the optimizer's
    state), within 10% of the prior's terms. Their host peaks are not held here: the prior is 16-28% under them
    (the processes' imports and what the allocator keeps of their setup), which the fits correct. One row of 16
    tokens per sub-batch: their peaks are the weights', gradients' and optimizer's, and a bfloat16 matmul on a CPU
    without bf16 instructions runs at a hundredth of float32's rate (1.2 against 118 GFLOP/s here), so two rows of
    32 made each case 36-57 s, this 10-15 s (ratios 0.98-1.04 on 2026-11-28)."""
    spec = TrialSpec(model="llama-small", dtype="bfloat16", sub_batch_size=1, num_sub_batches=2, seq_len=16, steps=1,
                     min_time_s=0.0, max_steps=1, remeasure=0, profile=False, **knobs)
    prior = predict(Setup.of_trial(spec, shape_of(spec.model, spec.dtype)), Candidate.from_knobs(spec.knobs()))
    result = run_trial(spec)
    assert result.status == "ok", result.error
    assert prior.device == pytest.approx(result.peak_device_bytes, rel=0.10), (prior.device_terms,
                                                                             result.peak_device_bytes)
