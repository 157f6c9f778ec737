"""Device memory (sltune.runtime.memory): a step over device_memory_limit fails like an out-of-memory and leaves the
model untouched; on CUDA the limit is checked and reported on the figure the caching allocator enforces (a model of
the allocator here: no GPU)."""

import pytest
import torch

import sltune
from sltune import DeviceMemoryExceeded, SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.runtime.memory import CudaMemoryMonitor
from tests.support.reference import adamw, assert_same_updates, plain_training, snapshot

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


GiB = 2**30


class Allocator:
    """A model of the caching allocator: the fraction bounds reserved memory, which fragmentation keeps
    above what is allocated."""

    def __init__(self, total: int):
        self.total, self.fraction = total, 1.0
        self.reserved = self.peak_reserved = 0

    def total_memory(self, device):
        return self.total

    def set_fraction(self, fraction, device):
        self.fraction = fraction

    def reset_peak(self, device):
        self.peak_reserved = self.reserved

    def max_reserved(self, device):
        return self.peak_reserved

    def reserve(self, nbytes: int):
        if self.reserved + nbytes > self.fraction * self.total:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes / 2**20:.2f} MiB. GPU 0 ...")
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)


def test_the_limit_is_checked_and_reported_on_the_figure_the_allocator_enforces():
    alloc = Allocator(total=80 * GiB)
    mon = CudaMemoryMonitor(torch.device("cuda", 0), limit=8 * GiB, allocator=alloc)
    assert alloc.fraction == pytest.approx(0.1)
    with mon.tracking(True):
        alloc.reserve(6 * GiB)                  # tensors of 5 GiB in 6 GiB of fragmented blocks
    assert mon.peak == 6 * GiB
    with pytest.raises(DeviceMemoryExceeded) as err, mon.tracking(True):
        alloc.reserve(3 * GiB)                  # 6 + 3 > 8: the allocator refuses
    assert err.value.peak_bytes == 9 * GiB and err.value.limit_bytes == 8 * GiB
    assert mon.peak == 6 * GiB


def test_a_limit_set_back_to_none_gives_the_device_back():
    alloc = Allocator(total=80 * GiB)
    CudaMemoryMonitor(torch.device("cuda", 0), limit=8 * GiB, allocator=alloc)
    CudaMemoryMonitor(torch.device("cuda", 0), limit=None, allocator=alloc)
    assert alloc.fraction == 1.0
    alloc.reserve(20 * GiB)
