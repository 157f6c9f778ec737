"""The step-time prior (sltune.tuning.cost.step_time) over rates given here, so each figure can be checked by hand:
how the phase plan's work scales with the knobs, what the lanes hide on a GPU, and the refusals of rates that lack
a kind of work. How close it comes to real trials is bench/prior_time.py's to measure, not a test's."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pytest

from sltune.machine.fingerprint import Fingerprint
from sltune.machine.rates import AttentionRate, MachineRates, MatmulRate, Rate
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.cost.step_time import SLICES, Lanes, MissingRate, RatesAt, interpolate, step_time
from sltune.tuning.cost.workload import workload_for
from sltune.tuning.space import Candidate

SEQ = 48                    # no width of llama-tiny (64, 32, 176): a weight gradient's k is the rows


def rate(median: float, spread: float = 0.0) -> Rate:
    return Rate(median=median, low=median * (1 - spread), high=median * (1 + spread), samples=3, unit="x")


def rates_for(model: str = "llama-tiny", device: str = "cpu", spread: float = 0.0, copy: float = 1e9,
              **changes) -> MachineRates:
    """Rates at every shape of `model` at SEQ tokens per row: 1e9 FLOP/s and elements/s, `copy` bytes/s."""
    w = workload_for(shape_of(model, "float32"), SEQ, (SEQ, 8 * SEQ))
    copies = {"host": rate(copy, spread)} if device == "cpu" else \
        {f"{d}.pinned": rate(copy, spread) for d in ("h2d", "d2h")}
    out = MachineRates(
        fingerprint=Fingerprint(cpu="test", cores=2, memory_bytes=1 << 30, gpus=(), torch="test"),
        measured_at=datetime.now(timezone.utc), seconds=1.0, device=device, threads=2,
        matmul=[MatmulRate(rows=r, k=k, n=n, dtype="float32", flops=rate(1e9, spread)) for k, n in w.matmuls
                for r in w.rows]        # each weight's forward, and its gradient (out x rows @ rows x in)
        + [MatmulRate(rows=n, k=r, n=k, dtype="float32", flops=rate(1e9, spread)) for k, n in w.matmuls
           for r in w.rows],
        attention=[AttentionRate(batch=r // SEQ, heads=w.heads, seq=SEQ, head_dim=w.head_dim, dtype="float32",
                                 flops=rate(1e9, spread)) for r in w.rows],
        elementwise={"float32": rate(1e9, spread)}, norm={"float32": rate(1e9, spread)},
        optimizer={"torch.adamw": rate(1e8, spread)}, copies=copies, op_overhead=rate(1e5, spread))
    return out.model_copy(update=changes)


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


def test_what_it_does_not_model_yet_is_none():
    assert step_time(recipe(), Candidate(1, 1, None, backend="fsdp"), rates_for()) is None
    assert step_time(recipe(mode="generate"), Candidate(1, 1, 1, kv_cache="host"), rates_for()) is None
