"""Where generation's KV caches live between steps: one block per (group, sub-batch), on the host or the device.

Generation walks the groups once per step and runs every sub-batch through each, so each sub-batch needs
its own keys and values for each group. They live in one block per (group, sub-batch), laid out
position-major:

    block[g][i] : [T, 2, k_g, b, kv_heads, head_dim]     T = prompt + new tokens, 2 = keys/values

so any run of positions of a block is one contiguous span. Each layer's keys and values are strided views
[b, kv_heads, positions, head_dim] of it, the values a transformers DynamicCache would hold. The
transformers Cache that writes into a block and hands those views to attention is generate.SlotCache.

`kv_cache` places them (e = itemsize, kvh*d = key/value heads x head dim, L = layers, q = positions the
step adds: the prompt length at the prefill, 1 per decode step):

    device  DeviceKV: every block on the device for the whole call; a step writes its q new positions
            into the block in place. Traffic: none. Device memory: 2*L*b*N*T*kvh*d*e.
    host    HostKV (CPU device): the blocks stay in host memory and attention runs over the past where it
            lives (FlexGen's CPU delegation; on the CPU the host is the device's memory). The new keys and
            values are copied into the host block. Per step: kv_offload = N*q*2*L*b*kvh*d*e, kv_load = 0.
            Device memory: none.
    host    StagedHostKV (CUDA device): the past a group attends to is staged on the device for each
            sub-batch (two staging buffers, the next sub-batch's load overlapping this one's compute) and
            the new positions are written back. Per step: kv_offload as above, kv_load = the visible past,
            N*sum_l (past - first_visible_l)*2*b*kvh*d*e (a sliding layer sees at most window-1 of it).

On the CPU, staging costs a copy of the whole visible past every step, where delegation costs nothing
more than the new positions (bench/generate.py --staged measures it), so `host` delegates there.
Attention on the host CPU beside a CUDA device is not implemented yet; there `host` stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from sltune.runtime.memory import DeviceMemory
from sltune.runtime.params import BufferPool
from sltune.runtime.transfer import Copier, Pending

# How a step's new positions reach a block: copy(dst, src).
Writer = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class KVShape:
    """Everything that sizes the blocks of one generate call."""

    group_layers: tuple[int, ...]   # layers per group
    num_sub_batches: int
    sub_batch_size: int
    kv_heads: int
    head_dim: int
    capacity: int                   # positions: prompt + new tokens
    dtype: torch.dtype

    def block_shape(self, g: int) -> tuple[int, ...]:
        return (self.capacity, 2, self.group_layers[g], self.sub_batch_size, self.kv_heads, self.head_dim)

    def block_numel(self, g: int) -> int:
        return self.capacity * 2 * self.group_layers[g] * self.sub_batch_size * self.kv_heads * self.head_dim


class KVStore(Protocol):
    """What generate asks of a placement: a block to bind for (group, sub-batch), and how to write into it."""

    in_place: bool      # blocks stay where they are between steps (nothing staged): all can be bound at once

    def prepare(self, shape: KVShape) -> None: ...
    def load(self, g: int, i: int, start: int, past: int) -> Pending: ...
    def writer(self) -> Writer: ...
    def store(self, g: int, i: int, block: torch.Tensor, past: int, new: int) -> None: ...
    def close_all(self) -> None: ...


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class DeviceKV:
    """Every block on the device for the whole call: new positions are written in place, nothing moves."""

    in_place = True

    def __init__(self, memory: DeviceMemory, device: torch.device):
        self.memory = memory
        self.device = device
        self._blocks: list[list[torch.Tensor]] = []
        self._held = 0

    def prepare(self, shape: KVShape) -> None:
        self.close_all()
        with self.memory.paused():
            self._blocks = [[torch.empty(shape.block_shape(g), dtype=shape.dtype, device=self.device)
                             for _ in range(shape.num_sub_batches)] for g in range(len(shape.group_layers))]
        self._held = sum(b.numel() * b.element_size() for row in self._blocks for b in row)
        self.memory.alloc(self._held)     # over the device limit: DeviceMemoryExceeded, as on CUDA

    def load(self, g: int, i: int, start: int, past: int) -> Pending:
        return Pending(self._blocks[g][i])

    def writer(self) -> Writer:
        return _copy

    def store(self, g: int, i: int, block: torch.Tensor, past: int, new: int) -> None:
        """Already in place."""

    def close_all(self) -> None:
        self._blocks = []
        self.memory.free(self._held)
        self._held = 0


class _HostBlocks:
    """One host buffer per group, [N, T, 2, k, b, heads, head_dim], kept for the next call of the same shape."""

    def __init__(self, copier: Copier, memory: DeviceMemory):
        self.copier = copier
        self.memory = memory
        self.shape: KVShape | None = None
        self._host: list[torch.Tensor] = []

    def _allocate(self, shape: KVShape) -> None:
        if shape != self.shape:
            self._host = []
            with self.memory.paused():
                self._host = [self.copier.host_empty((shape.num_sub_batches, *shape.block_shape(g)), shape.dtype)
                              for g in range(len(shape.group_layers))]
            self.shape = shape


class HostKV(_HostBlocks):
    """Blocks in host memory, bound as they are: attention reads the past where it lives (CPU delegation)
    and only the new positions are copied in, through the copier that counts them."""

    in_place = True

    def prepare(self, shape: KVShape) -> None:
        self._allocate(shape)

    def load(self, g: int, i: int, start: int, past: int) -> Pending:
        return Pending(self._host[g][i])

    def writer(self) -> Writer:
        return lambda dst, src: self.copier.to_host(src, dst, "kv_offload_bytes")

    def store(self, g: int, i: int, block: torch.Tensor, past: int, new: int) -> None:
        """Written by the layers already."""

    def close_all(self) -> None:
        """Nothing held on the device."""


class StagedHostKV(_HostBlocks):
    """Blocks in host memory, the visible past staged on the device per sub-batch; two staging buffers so
    the next sub-batch's block loads while this one computes."""

    in_place = False

    def __init__(self, copier: Copier, pool: BufferPool, memory: DeviceMemory):
        super().__init__(copier, memory)
        self.pool = pool
        self._staging: list[torch.Tensor] = []
        self._turn = 0
        self._last_write: Pending | None = None

    def prepare(self, shape: KVShape) -> None:
        self.close_all()
        self._allocate(shape)
        largest = max(shape.block_numel(g) for g in range(len(shape.group_layers)))
        self._staging = [self.pool.acquire(largest, shape.dtype) for _ in range(2)]

    def load(self, g: int, i: int, start: int, past: int) -> Pending:
        """Stage block (g, i) with positions start..past-1 loaded: one contiguous copy. The buffer may still
        be the source of the last write-back, so the block is ready only after that write has landed."""
        buf = self._staging[self._turn]
        self._turn ^= 1
        block = buf[:self.shape.block_numel(g)].view(self.shape.block_shape(g))
        if past <= start:   # nothing to load, but compute must not overwrite what a write-back still reads
            return Pending(block, None if self._last_write is None else self._last_write.event)
        pending = self.copier.to_device(self._host[g][i, start:past], "kv_load_bytes", out=block[start:past],
                                        after=self._last_write)
        return Pending(block, pending.event)

    def writer(self) -> Writer:
        return _copy

    def store(self, g: int, i: int, block: torch.Tensor, past: int, new: int) -> None:
        """Write the positions this step added (past..past+new-1) back to the host: one contiguous copy."""
        self._last_write = self.copier.to_host(block[past:past + new], self._host[g][i, past:past + new],
                                               "kv_offload_bytes")

    def close_all(self) -> None:
        """Give the staging buffers back (the host blocks stay for the next call)."""
        for buf in self._staging:
            self.pool.release(buf)
        self._staging = []
        self._turn = 0
        self._last_write = None


def kv_store(schedule: str, kv_cache: str, copier: Copier, pool: BufferPool, memory: DeviceMemory) -> KVStore:
    """The placement a config asks for. `resident` keeps everything on the device, its caches too."""
    if schedule == "resident" or kv_cache == "device":
        return DeviceKV(memory, copier.device)
    if copier.streams is None:      # synchronous copies: the host blocks can be read where they lie
        return HostKV(copier, memory)
    return StagedHostKV(copier, pool, memory)
