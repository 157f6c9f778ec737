"""The step-time prior (sltune.tuning.cost.step_time) over rates given here, so each figure can be checked by hand:
how the phase plan's work scales with the knobs, what the lanes hide on a GPU, and the refusals of rates that lack
a kind of work. How close it comes to real trials is bench/prior_time.py's to measure, not a test's."""

from __future__ import annotations

import dataclasses

import pytest

from sltune.machine.rates import MachineRates, Rate
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.cost.step_time import SLICES, Lanes, MissingRate, RatesAt, interpolate, step_time
from sltune.tuning.cost.workload import workload_for
from sltune.tuning.space import Candidate
from tests.support.rates import SEQ, rate, rates_for


def recipe(**changes) -> Setup:
    return dataclasses.replace(Setup("llama-tiny", shape_of("llama-tiny", "float32"), seq_len=SEQ,
                                     mixed_precision=False), **changes)


def test_the_breakdown_adds_up_to_the_step_within_the_rates_interval():
    rates = rates_for(spread=0.2)
    st = step_time(recipe(), Candidate(2, 2, 1), rates)
    assert set(st.breakdown) == set(SLICES)
    assert st.seconds == pytest.approx(sum(st.breakdown.values()))
    assert st.fastest < st.seconds < st.slowest
    assert st.tokens == 2 * 2 * SEQ and st.tokens_per_s == pytest.approx(st.tokens / st.seconds)
    shown = st.to_dict()
    assert sum(shown["predicted_breakdown"].values()) == pytest.approx(1.0)
    lo, hi = shown["predicted_tokens_per_s_interval"]
    assert lo < shown["predicted_tokens_per_s"] < hi


def test_the_slices_are_the_trial_breakdown_s():
    from sltune.profiling.breakdown import SLICES as MEASURED

    assert SLICES == MEASURED


def test_compute_follows_the_phase_plan():
    """Twice the sub-batches, twice the compute; offload drops the recompute a recomputing backward runs (a body
    group's forward again) and moves the saved tensors instead; a larger group adds no work but fewer loads."""
    rates, r = rates_for(), recipe()
    one, two = (step_time(r, Candidate(2, n, 1), rates).breakdown for n in (1, 2))
    assert two["compute"] == pytest.approx(2 * one["compute"])
    recompute = step_time(r, Candidate(2, 2, 1, "recompute"), rates).breakdown
    offload = step_time(r, Candidate(2, 2, 1, "offload"), rates).breakdown
    assert offload["compute"] < recompute["compute"] and offload["memcpy"] > recompute["memcpy"]
    lanes = Lanes(_at(rates), r, Candidate(2, 1, 1), None)
    layers = r.shape.layers         # a recomputing body layer runs two forwards and its backward, the last group one
    forward, backward = lanes.layer_forward_s(), lanes.layer_backward_s()
    body = (layers - 1) * (2 * forward + backward) + forward + backward + lanes.head_forward_s() \
        + lanes.head_backward_s() + lanes.loss_s()
    assert one["compute"] == pytest.approx(body, rel=0.02)      # the embedding's and the gradient sums' on top


def _at(rates: MachineRates) -> RatesAt:
    return RatesAt(rates, "float32", "median")


def test_a_weight_s_gradient_is_timed_at_its_own_shape():
    """Reduced over the rows, a weight's gradient runs far slower per FLOP at a few rows on a CPU than the forward's
    matmul: a backward is twice its forward only where both rates agree."""
    rates, r = rates_for(), recipe()
    lanes = Lanes(_at(rates), r, Candidate(1, 1, 1), None)
    assert lanes.layer_backward_s() == pytest.approx(2 * lanes.layer_forward_s())
    w = workload_for(r.shape, SEQ, (SEQ,))
    slow = rates.model_copy(update={"matmul": [m if m.k != SEQ else m.model_copy(update={"flops": rate(1e8)})
                                               for m in rates.matmul]})
    hidden = r.shape.hidden
    assert all(m.k == SEQ for m in slow.matmul if m.flops.median == 1e8) and (hidden, hidden) in w.matmuls
    slower = Lanes(_at(slow), r, Candidate(1, 1, 1), None)
    assert slower.layer_forward_s() == pytest.approx(lanes.layer_forward_s())
    # the weights' gradients take ten times as long: half the backward's matmuls
    matmuls = sum(2 * 2 * SEQ * k * n / 1e9 for k, n in lanes.weights())
    assert slower.layer_backward_s() - lanes.layer_backward_s() == pytest.approx(9 * matmuls / 2)


def test_canonical_loads_every_unit_per_sub_batch_and_resident_moves_nothing():
    rates = rates_for(copy=1e8)
    speedloader = step_time(recipe(), Candidate(1, 4, 1), rates).breakdown["memcpy"]
    canonical = step_time(recipe(schedule="canonical"), Candidate(1, 4, 1), rates).breakdown["memcpy"]
    resident = step_time(recipe(schedule="resident"), Candidate(1, 4, 1), rates).breakdown["memcpy"]
    assert canonical > 2 * speedloader and resident == 0
    on_gpu = step_time(recipe(schedule="resident", device="cuda"), Candidate(1, 4, 1), rates_for(device="cuda"))
    assert on_gpu.breakdown["memcpy"] == 0 and on_gpu.breakdown["compute"] > 0


def test_a_gpu_s_copy_stream_hides_copies_under_compute_which_the_cpu_runs_in_line():
    cpu = step_time(recipe(), Candidate(4, 2, 1), rates_for()).breakdown
    gpu = step_time(recipe(device="cuda"), Candidate(4, 2, 1), rates_for(device="cuda")).breakdown
    assert gpu["compute"] == pytest.approx(cpu["compute"])
    assert 0 <= gpu["memcpy"] < cpu["memcpy"]
    # copies slower than all compute: the step waits for them, and the compute hides only its own share
    slow = step_time(recipe(device="cuda"), Candidate(4, 2, 1), rates_for(device="cuda", copy=1e5)).breakdown
    serial = step_time(recipe(), Candidate(4, 2, 1), rates_for(copy=1e5)).breakdown
    assert serial["memcpy"] - slow["compute"] <= slow["memcpy"] < serial["memcpy"]


def test_the_exposed_copies_follow_the_prefetch_of_one_phase():
    # loads of 1 s before each of three 2 s phases: only the first is exposed
    assert Lanes.exposed_copies([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], [0.0] * 3, [0.0] * 3) == pytest.approx(1.0)
    # loads longer than the phases: the copy stream is busy 6 s, and the last phase computes after it (7 s in all)
    assert Lanes.exposed_copies([1.0, 1.0], [3.0, 3.0], [0.0, 0.0], [0.0, 0.0]) == pytest.approx(5.0)
    # a phase's outputs go out while it computes: 1.5 s of them past a 1 s phase show 0.5 s
    assert Lanes.exposed_copies([1.0], [0.0], [1.5], [0.0]) == pytest.approx(0.5)


def test_rates_between_measured_row_counts_are_interpolated_in_log_space():
    assert interpolate([(100, 1.0), (10_000, 3.0)], 1_000) == pytest.approx(2.0)
    assert interpolate([(100, 1.0), (10_000, 3.0)], 10) == 1.0
    assert interpolate([(100, 1.0), (10_000, 3.0)], 10**6) == 3.0


def test_rates_that_lack_a_kind_of_work_say_how_to_measure_it():
    with pytest.raises(MissingRate, match=r"no bfloat16 matmuls.*sltune calibrate SPEC"):
        step_time(dataclasses.replace(recipe(), shape=shape_of("llama-tiny", "bfloat16")), Candidate(1, 1, 1),
                  rates_for())
    with pytest.raises(MissingRate, match="--ranks 2"):
        step_time(recipe(world_size=2), Candidate(1, 1, 1), rates_for())
    with pytest.raises(MissingRate, match="torch.sgd"):
        from sltune.training.optimizer import OptimizerConfig

        step_time(recipe(optimizer=OptimizerConfig(name="sgd")), Candidate(1, 1, 1), rates_for())


def generate(**changes) -> Setup:
    return recipe(**{"mode": "generate", "prompt_len": 16, "new_tokens": 9, **changes})


def test_a_generate_call_loads_the_weights_it_streams_at_each_of_its_steps():
    """The prefill and new_tokens - 1 decode steps each load every unit not kept on the device (a kept one loads
    once); canonical loads per sub-batch; resident nothing. Tokens: a row's new tokens, every row."""
    shape, copy = generate().shape, 1e6
    rates = rates_for(copy=copy)
    streamed = step_time(generate(), Candidate(2, 2, 1, kv_cache="device", weights_on_device=0.0), rates)
    loads = 9 * shape.param_bytes / copy             # the boundary activations: a few KiB a step, within 3%
    assert loads <= streamed.breakdown["memcpy"] <= 1.03 * loads
    assert streamed.tokens == 2 * 2 * 9
    kept = step_time(generate(), Candidate(2, 2, 1, kv_cache="device", weights_on_device=1.0), rates)
    assert shape.param_bytes / copy <= kept.breakdown["memcpy"] <= shape.param_bytes / copy + 0.03 * loads
    canonical = step_time(generate(schedule="canonical"), Candidate(2, 2, 1, kv_cache="device"), rates)
    assert canonical.breakdown["memcpy"] == pytest.approx(2 * loads, rel=0.03)
    assert step_time(generate(schedule="resident"), Candidate(2, 2, 1), rates).breakdown["memcpy"] == 0


def test_a_decode_step_runs_a_sub_batch_s_rows_and_attends_over_the_past():
    """Each extra new token is one more decode step: b rows a sub-batch through every layer's matmuls (and the head's
    last position), its attention over the past, which grows by a position a step."""
    rates, c = rates_for(), Candidate(2, 1, 1, kv_cache="device", weights_on_device=1.0)
    shape = generate().shape
    one, two, three = (step_time(generate(new_tokens=t), c, rates).breakdown["compute"] for t in (1, 2, 3))
    matmuls = 2 * 2 * (sum(k * n for k, n in Lanes(RatesAt(rates, "float32", "median"), generate(), c, None).weights())
                       * shape.layers + shape.hidden * shape.vocab) / 1e9
    attention = 4 * 2 * (shape.hidden // shape.head_dim) * shape.head_dim / 1e9    # per position of past
    assert two - one > matmuls                       # the decode step's matmuls, and its other work
    assert (three - two) - (two - one) == pytest.approx(shape.layers * attention, rel=1e-6)    # one position more


def test_a_gpu_overlaps_a_unit_s_load_with_the_one_before_and_stages_host_kv_caches():
    cpu = step_time(generate(), Candidate(2, 2, 1, kv_cache="host"), rates_for()).breakdown
    gpu = step_time(generate(device="cuda"), Candidate(2, 2, 1, kv_cache="host"), rates_for(device="cuda")).breakdown
    assert gpu["compute"] == pytest.approx(cpu["compute"]) and gpu["memcpy"] < cpu["memcpy"]
    slow = rates_for(device="cuda", copy=1e5)
    staged = step_time(generate(device="cuda"), Candidate(2, 2, 1, kv_cache="host"), slow).breakdown["memcpy"]
    on_device = step_time(generate(device="cuda"), Candidate(2, 2, 1, kv_cache="device"), slow).breakdown["memcpy"]
    assert staged > on_device                       # the past copied in for every decode step


def test_generation_without_decode_rates_says_to_calibrate_at_a_generate_spec():
    with pytest.raises(MissingRate, match="decode attention.*generate spec"):
        step_time(generate(), Candidate(1, 1, 1, kv_cache="host"), rates_for(decode_attention=[]))


def wrapped(backend: str, b: int = 2, n: int = 1, activations: str = "recompute", **knobs) -> Candidate:
    return Candidate(b, n, None, activations, backend=backend, **knobs)


def collectives(world: int, bytes_per_s: float = 1e8) -> dict[str, Rate]:
    return {f"{op}.{world}": rate(bytes_per_s) for op in ("all_gather", "reduce_scatter")}


def test_a_wrapped_micro_batch_runs_the_whole_model_and_checkpointing_its_forward_again():
    """Each of DeepSpeed's and FSDP's micro-batches is a SpeedLoader sub-batch's work over every layer: the same
    work functions, so a wrapped config and a SpeedLoader one of one group compute alike; recompute adds one
    forward of every layer."""
    rates, r = rates_for(), recipe()
    lanes = Lanes(_at(rates), r, Candidate(2, 1, 1), None)
    layers = r.shape.layers
    model = layers * (lanes.layer_forward_s() + lanes.layer_backward_s()) + lanes.head_forward_s() \
        + lanes.head_backward_s() + lanes.loss_s()
    for backend in ("deepspeed", "fsdp"):
        offload, recompute = (step_time(r, wrapped(backend, activations=a, zero_stage=2), rates).breakdown
                              for a in ("offload", "recompute"))
        assert offload["compute"] == pytest.approx(model, rel=0.1)          # and the wrapper's elementwise work
        assert recompute["compute"] - offload["compute"] == pytest.approx(layers * lanes.layer_forward_s())
        two = step_time(r, wrapped(backend, n=2, activations="offload", zero_stage=2), rates).breakdown
        assert two["compute"] == pytest.approx(2 * offload["compute"], rel=0.1)


def test_zero_3_gathers_every_module_twice_per_micro_batch_and_zero_2_once_per_step():
    """Over two ranks: ZeRO-3 all-gathers the weights for every forward and backward of every micro-batch, ZeRO-2
    the updated partitions once a step; both reduce-scatter every micro-batch's gradients."""
    rates = rates_for(collectives=collectives(2))
    r = recipe(world_size=2)
    params = r.shape.param_bytes
    for n in (1, 3):
        z3 = step_time(r, wrapped("deepspeed", n=n, zero_stage=3), rates).breakdown
        z2 = step_time(r, wrapped("deepspeed", n=n, zero_stage=2), rates).breakdown
        assert z3["all_gather"] == pytest.approx(n * 2 * params / 1e8)
        assert z2["all_gather"] == pytest.approx(params / 1e8)
        assert z3["reduce_scatter"] == z2["reduce_scatter"] == pytest.approx(n * params / 1e8)
    with pytest.raises(MissingRate, match="--ranks 2"):
        step_time(r, wrapped("deepspeed", zero_stage=3), rates_for())


def test_fsdp_gathers_each_layer_again_for_its_backward_only_when_it_resharded():
    rates = rates_for(collectives=collectives(2))
    r = recipe(world_size=2)
    resharded, kept = (step_time(r, wrapped("fsdp", n=2, reshard_after_forward=flag), rates).breakdown
                       for flag in (True, False))
    shape = r.shape
    layers = shape.layers * shape.layer_bytes
    assert resharded["all_gather"] - kept["all_gather"] == pytest.approx(2 * layers / 1e8)
    # the gradients reduce-scattered once, on the last micro-batch, in float32 (as many bytes here), from a flat
    # buffer they are copied into, to the shard copied out (at the copy rate, 1e9 bytes/s)
    params = shape.param_bytes
    assert resharded["reduce_scatter"] == pytest.approx(params / 1e8 + (params + params / 2) / 1e9)


def test_an_offloaded_optimizer_steps_on_the_host_with_deepspeed_s_cpu_adam_where_it_was_timed():
    rates, r = rates_for(), recipe()
    params = r.shape.param_bytes // r.shape.itemsize
    on_device = step_time(r, wrapped("deepspeed", zero_stage=2, offload_optimizer="none"), rates).breakdown
    torch_adam = step_time(r, wrapped("deepspeed", zero_stage=2, offload_optimizer="cpu"), rates).breakdown
    assert torch_adam["cpu"] - on_device["cpu"] == pytest.approx(params / 1e8)      # torch.adamw's rate
    faster = rates.model_copy(update={"optimizer": {**rates.optimizer, "deepspeed.cpu_adam": rate(1e9)}})
    cpu_adam = step_time(r, wrapped("deepspeed", zero_stage=2, offload_optimizer="cpu"), faster).breakdown
    assert cpu_adam["cpu"] - on_device["cpu"] == pytest.approx(params / 1e9)
    assert torch_adam["memcpy"] > 0 == on_device["memcpy"]                          # gradients out, weights back
    fsdp = step_time(r, wrapped("fsdp", cpu_offload=True), rates).breakdown
    assert fsdp["cpu"] > step_time(r, wrapped("fsdp", cpu_offload=False), rates).breakdown["cpu"]


def test_a_gpu_hides_a_wrapped_step_s_collectives_under_its_compute():
    r, c = recipe(world_size=2), wrapped("deepspeed", n=2, zero_stage=3)
    cpu = step_time(r, c, rates_for(collectives=collectives(2))).breakdown
    gpu = step_time(dataclasses.replace(r, device="cuda"), c, rates_for(device="cuda", collectives=collectives(2)))
    assert gpu.breakdown["compute"] == pytest.approx(cpu["compute"])
    assert gpu.breakdown["all_gather"] + gpu.breakdown["reduce_scatter"] == pytest.approx(
        max(0.0, cpu["all_gather"] + cpu["reduce_scatter"] - cpu["compute"]))
