"""The CUDA stream logic, run on the CPU by the emulated asynchronous device: copies complete as late as
the ordering allows, so a missing wait, event or record gives wrong numbers (or a refusal) here, not a
rare race on the first GPU."""

import gc
import math
from typing import get_args

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.runtime.emulated import EmulatedStreams
from sltune.runtime.memory import DeviceMemory
from sltune.runtime.params import BufferPool
from sltune.runtime.pinned import IN_PLACE_FROM, PAGE
from sltune.runtime.streams import ENV
from sltune.runtime.counters import IOCounters
from sltune.runtime.transfer import Copier, Pending
from tests.support.reference import adamw
from tests.support.runtime import PAD, batch, check, run_engine


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setenv(ENV, "lazy")


def copier() -> Copier:
    return Copier(torch.device("cpu"), IOCounters(), EmulatedStreams())


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


def test_a_copy_is_not_done_until_something_waits_for_it():
    c = copier()
    src, out = torch.arange(6.0), torch.zeros(6)
    pending = c.to_device(src, "act_load_bytes", out=out)
    assert torch.equal(out, torch.zeros(6)) and not pending.event.query()
    assert torch.equal(pending.wait(), src)
    host = torch.zeros(6)
    back = c.to_host(src * 2, host, "act_offload_bytes")
    assert torch.equal(host, torch.zeros(6))
    assert torch.equal(back.wait(), src * 2)          # a device->host result waits on the device's stream


def test_an_input_load_does_not_queue_behind_the_next_units_parameters():
    """Finding 3: parameters have a stream of their own, so waiting for an activation does not wait for the
    next unit's (much larger) parameter copy issued before it."""
    c = copier()
    params = c.to_device(torch.ones(1 << 16), "param_load_bytes")
    act = c.to_device(torch.ones(8), "act_load_bytes")
    act.wait()
    assert not params.event.query()
    kv = c.to_device(torch.ones(8), "kv_load_bytes")
    kv.wait()
    assert not params.event.query()
    params.wait()
    assert params.event is None and torch.equal(params.tensor, torch.ones(1 << 16))


def test_a_device_buffer_used_on_a_stream_without_record_is_refused():
    streams = EmulatedStreams()
    side = streams.stream()
    with pytest.raises(RuntimeError, match="without record"):
        streams.copy(side, torch.zeros(4), torch.ones(4), device_side=torch.zeros(4))


def test_a_released_buffer_is_reused_only_after_the_copy_reading_it_ends():
    """The pool plays CUDA's caching allocator: a buffer recorded on a stream waits for that stream's work."""
    c = copier()
    pool = BufferPool(c.device, DeviceMemory(), c.streams)
    buf = pool.acquire(4, torch.float32)
    buf.copy_(torch.arange(4.0))
    host = torch.zeros(4)
    c.to_host(buf, host, "grad_offload_bytes")            # still queued
    pool.release(buf)
    again = pool.acquire(4, torch.float32)
    assert again is buf and torch.equal(host, torch.arange(4.0))   # the reuse waited for the write-back
    again.fill_(7)
    c.synchronize()
    assert torch.equal(host, torch.arange(4.0))


def test_host_buffers_are_pinned_at_their_own_size(emulated):
    """Finding 5: torch's pinned allocator rounds each buffer up to a power of two (up to twice the memory);
    the runtime pins each large buffer's own pages, and counts them."""
    model = build({"model_type": "llama", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 704,
                   "num_hidden_layers": 1, "num_attention_heads": 4}, seed=0)
    eng = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=2, num_live_blocks=1,
                            schedule="canonical"), optimizer=adamw)
    eng.train_step(batch(2, 8))
    host = eng.copier.host
    buffers = [t for u in eng.units for t in (u.host, u.host_grad) if t is not None]
    buffers += eng.copier.staging
    large = [t.numel() * t.element_size() for t in buffers if t.numel() * t.element_size() >= IN_PLACE_FROM]
    assert len(large) >= 5
    exact = sum(-(-n // PAGE) * PAGE for n in large)
    assert host.pinned_bytes == host.peak_pinned_bytes == exact == sum(host.pinner.ranges.values())
    assert exact < 1.01 * sum(large) and sum(2 ** math.ceil(math.log2(n)) for n in large) > 1.2 * exact
    del eng, model, buffers
    gc.collect()
    assert host.pinned_bytes == 0 and host.pinner.ranges == {}      # unpinned with the last view
