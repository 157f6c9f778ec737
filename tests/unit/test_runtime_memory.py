"""device_memory_limit: a step over it fails like an out-of-memory and leaves the model untouched."""

import pytest
import torch

import sltune
from sltune import DeviceMemoryExceeded, SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from tests.support.reference import adamw, plain_training, snapshot, assert_same_updates

IDS = torch.randint(3, 512, (8, 32), generator=torch.Generator().manual_seed(0))


def peak(**knobs) -> int:
    engine = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(**knobs), optimizer=adamw)
    return engine.train_step(IDS[: knobs["sub_batch_size"] * knobs["num_sub_batches"]]).peak_device_bytes


def test_limit_below_peak_raises_and_leaves_everything_as_it_was():
    big = dict(sub_batch_size=8, num_sub_batches=1, num_live_blocks=4)
    small = dict(sub_batch_size=1, num_sub_batches=8, num_live_blocks=1)
    big_peak, small_peak = peak(**big), peak(**small)
    assert small_peak < big_peak
    limit = (small_peak + big_peak) // 2

    model = build("llama-tiny")
    before = snapshot(model)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(device_memory_limit=limit, **big), optimizer=adamw)
    with pytest.raises(DeviceMemoryExceeded) as err:
        engine.train_step(IDS)
    assert err.value.limit_bytes == limit and err.value.peak_bytes > limit
    assert str(limit) in str(err.value) and "sub_batch_size" in str(err.value)
    assert isinstance(err.value, torch.OutOfMemoryError)
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.device.type == "cpu" and p.data.data_ptr() != 0 for p in model.parameters())
    with pytest.raises(DeviceMemoryExceeded):   # the same engine fails the same way, not worse
        engine.train_step(IDS)

    # the same model, a smaller config under the same limit: trains exactly like plain PyTorch
    ref_model, ref_losses, ref_grads = plain_training(model, [IDS])
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(device_memory_limit=limit, **small), optimizer=adamw)
    res = engine.train_step(IDS)
    assert res.loss == pytest.approx(ref_losses[0], rel=1e-5)
    assert res.peak_device_bytes <= limit
    assert_same_updates(before, snapshot(model), snapshot(ref_model), ref_grads, steps=1)


def test_limit_accepts_human_sizes():
    assert SpeedLoaderConfig(device_memory_limit="2GiB").device_memory_limit == 2 * 1024**3
    assert SpeedLoaderConfig(device_memory_limit="1.5 GB").device_memory_limit == 1_500_000_000


def test_peak_is_measured_and_grows_with_sub_batch_and_live_blocks():
    base = dict(sub_batch_size=1, num_sub_batches=2, num_live_blocks=1)
    p0 = peak(**base)
    assert peak(**{**base, "sub_batch_size": 4}) > p0
    assert peak(**{**base, "num_live_blocks": 4}) > p0


def test_resident_counts_its_parameters_on_the_device():
    knobs = dict(sub_batch_size=2, num_sub_batches=2, num_live_blocks=1)
    resident = peak(schedule="resident", **knobs)
    offloaded = peak(schedule="speedloader", **knobs)
    params = sum(p.numel() * 4 for p in build("llama-tiny").parameters())
    assert resident > offloaded
    assert resident > 2 * params   # parameters and gradients (and AdamW state) live on the device


def test_tracking_never_reports_no_peak_and_rejects_a_limit():
    engine = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(memory_tracking="never"), optimizer=adamw)
    assert engine.train_step(IDS[:1]).peak_device_bytes is None
    with pytest.raises(ValueError, match="memory_tracking"):
        SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(memory_tracking="never",
                          device_memory_limit="1GiB"), optimizer=adamw)


def test_exception_is_exported():
    assert sltune.DeviceMemoryExceeded is DeviceMemoryExceeded
