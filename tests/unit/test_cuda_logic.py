"""The decisions the first GPU run depends on, as pure logic over the machine's facts (no GPU here)."""

import pytest
import torch

from sltune.runtime.device import CudaFacts, bf16_native, resolve_device
from sltune.runtime.memory import CudaMemoryMonitor, DeviceMemoryExceeded

GiB = 2**30


def test_each_rank_takes_the_gpu_of_its_local_rank():
    assert resolve_device("cuda", 4, CudaFacts(device_count=4, local_rank=3)) == torch.device("cuda", 3)
    assert resolve_device("cuda", 1, CudaFacts(device_count=4, current=2)) == torch.device("cuda", 2)
    assert resolve_device("cuda:1", 1, CudaFacts(device_count=2)) == torch.device("cuda", 1)
    assert resolve_device("cpu", 2, CudaFacts(0)) == torch.device("cpu")


def test_several_ranks_cannot_share_one_gpu():
    with pytest.raises(ValueError, match="names one GPU, but this process is one of 2 ranks"):
        resolve_device("cuda:0", 2, CudaFacts(device_count=2, local_rank=1))
    with pytest.raises(ValueError, match="local rank 2 needs GPU 2 but this machine shows 2"):
        resolve_device("cuda", 3, CudaFacts(device_count=2, local_rank=2))
    with pytest.raises(ValueError, match="does not exist; this machine has 2 GPUs"):
        resolve_device("cuda:2", 1, CudaFacts(device_count=2))
    with pytest.raises(ValueError, match="no CUDA"):
        resolve_device("cuda", 1, CudaFacts(device_count=0))


def test_bf16_needs_native_support():
    """V100 (7.0) and T4 (7.5) only emulate bfloat16; A100 (8.0), L4 (8.9), H100 (9.0) compute it."""
    assert not bf16_native((7, 0)) and not bf16_native((7, 5))
    assert bf16_native((8, 0)) and bf16_native((8, 9)) and bf16_native((9, 0))


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
