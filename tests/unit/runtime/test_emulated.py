"""The CUDA stream logic, run on the CPU by the emulated asynchronous device (sltune.runtime.emulated): copies
complete as late as the ordering allows, so a missing wait, event or record gives wrong numbers (or a refusal) here,
not a rare race on the first GPU."""

from typing import get_args

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.runtime.emulated import EmulatedStreams
from sltune.runtime.streams import ENV
from sltune.runtime.transfer import Pending
from tests.support.reference import adamw
from tests.support.runtime import PAD, batch, check, run_engine
from tests.support.runtime import emulated  # noqa: F401 - a fixture its tests ask for by name


def knob_values(name: str) -> list[dict]:
    """Every value of a config knob other branches are adding (activations, kv_cache), once it exists."""
    field = SpeedLoaderConfig.model_fields.get(name)
    return [{}] if field is None else [{name: v} for v in get_args(field.annotation)]


@pytest.mark.parametrize("extra", knob_values("activations"), ids=str)
@pytest.mark.parametrize("schedule", ["speedloader", "canonical", "resident"])
def test_training_is_exact_on_the_emulated_device(emulated, schedule, extra):
    """4 layers in groups of 3 and 1, three sub-batches."""
    check(*run_engine("llama-tiny", [batch(6, 12)], schedule=schedule,
                      sub_batch_size=2, num_sub_batches=3, num_live_blocks=3, **extra))


@pytest.mark.parametrize("schedule", ["speedloader", "canonical"])
def test_mixed_precision_is_exact_on_the_emulated_device(emulated, schedule):
    """bfloat16 compute with float32 masters: float32 gradient sums offloaded on the device-to-host stream
    (canonical: each micro-batch's bfloat16 gradients staged and added in float32), bit for bit the plain
    recipe's masters."""
    from tests.support.reference import mixed_training

    data = [batch(6, 12)]
    model = build("llama-tiny")
    ref, ref_losses, _ = mixed_training(model, data, 2, torch.bfloat16)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(dtype="bfloat16", schedule=schedule, sub_batch_size=2,
                                                        num_sub_batches=3, num_live_blocks=3), optimizer=adamw)
    assert engine.train_step(data[0]).loss == pytest.approx(ref_losses[0], rel=1e-6)
    ours = engine.state_dict()
    assert all(torch.equal(ours[k], v) for k, v in ref.state_dict().items())


def test_training_is_exact_when_copies_finish_at_random_times(monkeypatch):
    """A delay instead of 'as late as possible': copies run on their threads while compute goes on."""
    monkeypatch.setenv(ENV, "0.3")
    check(*run_engine("gpt2-tiny", [batch(4, 12)], sub_batch_size=1, num_sub_batches=4, num_live_blocks=2))


def test_a_missing_wait_fails_the_exactness_check(emulated, monkeypatch):
    """The emulation must be able to fail: a Pending.wait that does not wait gives another training step."""
    monkeypatch.setattr(Pending, "wait", lambda self: self.tensor)
    with pytest.raises(AssertionError):
        check(*run_engine("llama-tiny", [batch(6, 12)], sub_batch_size=2, num_sub_batches=3, num_live_blocks=3))


@pytest.mark.parametrize("preset,schedule,n,prompt", [
    ("llama-tiny", "speedloader", 3, 10), ("llama-tiny", "speedloader", 4, 10), ("llama-tiny", "speedloader", 6, 10),
    ("llama-tiny", "canonical", 3, 10),
    ("mistral-tiny", "speedloader", 3, 20),     # past its sliding window: partial block loads
])
@pytest.mark.parametrize("extra", knob_values("kv_cache"), ids=str)
def test_generation_tokens_are_exact_for_any_number_of_sub_batches(emulated, preset, schedule, n, prompt, extra):
    """Finding 1: at prefill nothing is loaded, yet sub-batch j+2's compute reuses the staging buffer that
    j's write-back still reads; N=3 and N=4 gave wrong tokens before the fix (N=2, the other tests' N, not)."""
    ids = torch.randint(3, 512, (n, prompt), generator=torch.Generator().manual_seed(n))
    cfg = SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=n, num_live_blocks=1, schedule=schedule,
                            memory_tracking="never", **extra)
    out = SpeedLoaderEngine(build(preset), cfg).generate(ids, max_new_tokens=6, pad_token_id=PAD)
    expected = build(preset).generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, expected), f"rows with wrong tokens: {(out != expected).any(1).tolist()}"


@pytest.mark.parametrize("schedule,weights,delay", [("speedloader", 0.5, "lazy"), ("speedloader", 1.0, "0.3"),
                                                     ("canonical", 0.5, "0.3")])
def test_weights_kept_on_the_device_are_exact_when_copies_finish_late(monkeypatch, schedule, weights, delay):
    """Kept units are loaded by the prefill's (late) copies and read at every later step without a copy; the
    streamed ones still prefetch beside them."""
    monkeypatch.setenv(ENV, delay)
    ids = torch.randint(3, 512, (3, 10), generator=torch.Generator().manual_seed(3))
    cfg = SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=3, num_live_blocks=1, schedule=schedule,
                            memory_tracking="never", weights_on_device=weights)
    engine = SpeedLoaderEngine(build("llama-tiny"), cfg)
    out = engine.generate(ids, max_new_tokens=6, pad_token_id=PAD)
    expected = build("llama-tiny").generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, expected), f"rows with wrong tokens: {(out != expected).any(1).tolist()}"
    loads = 3 if schedule == "canonical" else 1        # canonical streams every sub-batch's own load
    assert engine.last_generation.step_io[-1].param_load_bytes < loads * engine.param_bytes


def test_a_device_buffer_used_on_a_stream_without_record_is_refused():
    streams = EmulatedStreams()
    side = streams.stream()
    with pytest.raises(RuntimeError, match="without record"):
        streams.copy(side, torch.zeros(4), torch.ones(4), device_side=torch.zeros(4))
