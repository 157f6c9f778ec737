"""The byte counters follow the traffic table: SpeedLoader's parameter traffic does not grow with N."""

import pytest
import torch

from sltune import IOCounters, SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from tests.support.reference import adamw

SEQ = 16


def step_io(preset="llama-tiny", n=1, schedule="speedloader", b=2, k=1) -> tuple[IOCounters, SpeedLoaderEngine]:
    engine = SpeedLoaderEngine(build(preset), SpeedLoaderConfig(sub_batch_size=b, num_sub_batches=n,
                               num_live_blocks=k, schedule=schedule), optimizer=adamw)
    ids = torch.randint(3, 512, (b * n, SEQ), generator=torch.Generator().manual_seed(n))
    return engine.train_step(ids).io, engine


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny", "opt-tiny"])
def test_speedloader_parameter_traffic_does_not_grow_with_n(preset):
    io1, engine = step_io(preset, n=1)
    io8, _ = step_io(preset, n=8)
    p = engine.param_bytes
    assert io8.param_load_bytes == io1.param_load_bytes <= 2 * p
    assert io8.grad_offload_bytes == io1.grad_offload_bytes <= p
    assert io1.param_load_bytes > p   # everything but the head (and tied weights) loads twice
    assert io8.act_offload_bytes == 8 * io1.act_offload_bytes > 0
    assert io8.allgather_bytes == io8.reduce_scatter_bytes == 0


@pytest.mark.parametrize("preset", ["llama-tiny", "llama-tiny-tied"])
def test_canonical_traffic_is_n_times_one_micro_batch(preset):
    io1, _ = step_io(preset, n=1, schedule="canonical")
    io8, _ = step_io(preset, n=8, schedule="canonical")
    assert io8.param_load_bytes == 8 * io1.param_load_bytes
    assert io8.grad_offload_bytes == 8 * io1.grad_offload_bytes
    assert io8.act_offload_bytes == io8.act_load_bytes == 0


def test_resident_moves_nothing():
    io, _ = step_io(n=4, schedule="resident")
    assert io == IOCounters()


@pytest.mark.parametrize("schedule", ["speedloader", "canonical", "resident"])
@pytest.mark.parametrize("preset,k,n", [("llama-tiny", 1, 3), ("llama-tiny", 3, 2), ("llama-tiny-tied", 2, 4),
                                          ("gpt2-tiny", 4, 2), ("opt-tiny", 3, 5)])
def test_counters_equal_the_documented_formulas(preset, k, n, schedule):
    io, engine = step_io(preset, n=n, schedule=schedule, k=k)
    assert io == engine.expected_io(SEQ)


def test_formula_by_hand_for_llama_tiny():
    """The formulas spelled out once with numbers: 4 layers, k=2 (G=2), b=2, s=16, N=4, hidden 64, fp32.
    The last group and the head turn around (forward, loss, backward at once), so they load once."""
    io, engine = step_io("llama-tiny", n=4, k=2)
    units = {u.name: u.nbytes for u in engine.units}
    assert io.param_load_bytes == 2 * units["embed"] + 2 * units["layers[0:2]"] + units["layers[2:4]"] + units["head"]
    assert io.grad_offload_bytes == engine.param_bytes            # everything trainable
    edge = 2 * 16 * 64 * 4                                          # b*s*hidden*4 bytes
    # out: 2 group inputs forward, the turnaround's input gradient, group 0's input gradient
    assert io.act_offload_bytes == 4 * (2 + 1 + 1) * edge
    # in: 2 group inputs forward, group 0's input and output gradient (recompute), the embedding's gradient
    assert io.act_load_bytes == 4 * (2 + 2 + 1) * edge


def test_offload_by_hand_for_llama_tiny():
    """activations: offload, same shape: group 0's backward loads no input (nothing is recomputed) but every
    sub-batch's saved tensors go out and come back once."""
    engine = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=4,
                               num_live_blocks=2, activations="offload"), optimizer=adamw)
    io = engine.train_step(torch.randint(3, 512, (8, SEQ), generator=torch.Generator().manual_seed(4))).io
    edge, saved = 2 * 16 * 64 * 4, engine.saved.packed_bytes
    assert saved > 4 * 2 * edge                                    # two layers save more than their input each
    assert io.act_offload_bytes == 4 * (2 + 1 + 1) * edge + saved
    assert io.act_load_bytes == 4 * (2 + 1 + 1) * edge + saved


def test_counters_accumulate_on_the_engine():
    engine = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=2),
                               optimizer=adamw)
    ids = torch.randint(3, 512, (2, SEQ))
    a = engine.train_step(ids).io
    b = engine.train_step(ids).io
    assert engine.io == a + b


@pytest.mark.parametrize("schedule", ["speedloader", "canonical"])
@pytest.mark.parametrize("frozen", [["model.embed_tokens"], ["model.embed_tokens", "model.layers.0"],
                                    ["model.layers.1"]])
def test_counters_follow_the_phases_actually_run_with_a_frozen_prefix(frozen, schedule):
    """Fine-tuning the top of a model: no backward (no loads, no copies) below the lowest trainable layer."""
    model = build("llama-tiny")
    for name in frozen:
        model.get_submodule(name).requires_grad_(False)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=3, num_live_blocks=1,
                               schedule=schedule), optimizer=adamw)
    io = engine.train_step(torch.randint(3, 512, (6, SEQ))).io
    assert io == engine.expected_io(SEQ)
    full, _ = step_io(n=3, schedule=schedule)
    if frozen[0] == "model.embed_tokens":
        assert io.param_load_bytes < full.param_load_bytes       # the frozen embedding's backward is skipped
