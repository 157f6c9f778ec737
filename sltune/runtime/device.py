"""Which device a process computes on, and whether it can compute in a dtype.

The decisions are pure functions of the machine's facts (how many GPUs, their compute capability, which
rank this is), so the CPU tests check the logic the first GPU run depends on; `check_device` and
`check_dtype` read the facts from torch and the launcher's environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CudaFacts:
    """What decides a rank's GPU: visible devices, the current one, and the launcher's local rank."""

    device_count: int
    current: int = 0
    local_rank: int | None = None      # LOCAL_RANK (torchrun), else the global rank (one node)


def resolve_device(name: str, world: int, facts: CudaFacts) -> torch.device:
    """The device of this rank. With several ranks each takes cuda:LOCAL_RANK: an explicit index would put
    every rank on one GPU, so it is refused; so is a rank without a GPU of its own."""
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device {name!r} is not supported; use 'cpu' or 'cuda[:index]'")
    if facts.device_count == 0:
        raise ValueError(f"device {name!r} is not available on this machine (no CUDA); use device='cpu'")
    if world > 1:
        if device.index is not None:
            raise ValueError(f"device {name!r} names one GPU, but this process is one of {world} ranks and each "
                             "needs its own; use device='cuda' (every rank takes cuda:LOCAL_RANK)")
        local = facts.local_rank or 0
        if local >= facts.device_count:
            raise ValueError(f"local rank {local} needs GPU {local} but this machine shows "
                             f"{facts.device_count}; launch at most {facts.device_count} ranks per node")
        return torch.device("cuda", local)
    if device.index is not None and device.index >= facts.device_count:
        raise ValueError(f"device {name!r} does not exist; this machine has {facts.device_count} GPUs")
    return torch.device("cuda", facts.current if device.index is None else device.index)


def bf16_native(capability: tuple[int, int]) -> bool:
    """bfloat16 arithmetic in hardware: Ampere (8.0) and later. torch's is_bf16_supported() also accepts
    the emulated bf16 of older GPUs, which runs at a fraction of the speed the tuner would measure."""
    return tuple(capability) >= (8, 0)


def check_device(name: str) -> torch.device:
    """resolve_device with this machine's facts; a multi-rank CUDA process is pinned to its GPU."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if torch.device(name).type != "cuda":
        return resolve_device(name, world, CudaFacts(0))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = os.environ.get("LOCAL_RANK")
    rank = dist.get_rank() if world > 1 else 0
    facts = CudaFacts(count, torch.cuda.current_device() if count else 0,
                      int(local) if local is not None else rank)
    device = resolve_device(name, world, facts)
    if world > 1:
        torch.cuda.set_device(device)
    return device


def check_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Fail early, with the alternatives, if the device cannot compute in this dtype."""
    if device.type == "cuda" and dtype == torch.bfloat16 and \
            not bf16_native(torch.cuda.get_device_capability(device)):
        raise ValueError(f"{device} has no native bfloat16 (compute capability "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))} < 8.0); "
                         "use dtype='float16' or 'float32'")
    try:
        a = torch.ones(4, 4, dtype=dtype, device=device)
        torch.softmax(a @ a, dim=-1)
    except RuntimeError as err:
        raise ValueError(f"{device} cannot compute in {dtype} ({err}); use dtype='float32'") from None
