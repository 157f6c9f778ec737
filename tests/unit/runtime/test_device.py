"""Which device a process computes on (sltune.runtime.device): the decisions the first GPU run depends on, as pure
logic over the machine's facts (no GPU here), and CUDA asked for where there is none."""

import pytest
import torch

from sltune.runtime.device import CudaFacts, bf16_native, resolve_device
from tests.support.runtime import engine


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it():
    with pytest.raises(ValueError, match="not available.*use device='cpu'"):
        engine(device="cuda")
