"""Where generation's KV caches wait between steps: one block per (group, sub-batch).

Generation walks the groups once per step and runs every sub-batch through each, so each sub-batch needs
its own keys and values for each group. They wait between steps in one block per (group, sub-batch),
laid out position-major:

    block[g][i] : [T, 2, k_g, b, kv_heads, head_dim]     T = prompt + new tokens, 2 = keys/values

so any run of positions of a block is one contiguous span: a step loads the positions its layers will
attend to in one copy and writes back only the positions it added in one copy (the paper's buffer
"reshape"). On the device the block is staged in the same layout; each layer's keys and values are
strided views [b, kv_heads, positions, head_dim] of it, the values a transformers DynamicCache would hold.

HostKV keeps the blocks in host memory (the SpeedLoader schedule), with two device staging buffers so the
next sub-batch's block loads while this one computes. DeviceKV keeps them on the device (canonical and
resident schedules): no copies. The transformers Cache that writes into a block is generate.SlotCache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sltune.runtime.memory import DeviceMemory
from sltune.runtime.params import BufferPool
from sltune.runtime.transfer import Copier, Pending


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


class DeviceKV:
    """Every block on the device for the whole call (canonical and resident schedules): nothing moves."""

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
        self.memory.alloc(self._held)

    def load(self, g: int, i: int, start: int, past: int) -> Pending:
        return Pending(self._blocks[g][i])

    def store(self, g: int, i: int, block: torch.Tensor, past: int, new: int) -> None:
        """Already in place."""

    def close_all(self) -> None:
        self._blocks = []
        self.memory.free(self._held)
        self._held = 0



class HostKV:
    """Blocks in one host buffer per group, [N, T, 2, k, b, heads, head_dim]; two device staging buffers."""

    def __init__(self, copier: Copier, pool: BufferPool, memory: DeviceMemory):
        self.copier = copier
        self.pool = pool
        self.memory = memory
        self.shape: KVShape | None = None
        self._host: list[torch.Tensor] = []
        self._staging: list[torch.Tensor] = []
        self._turn = 0
        self._last_write: Pending | None = None

    def prepare(self, shape: KVShape) -> None:
        """Host blocks for this call's shape (kept for the next call of the same shape), staging on the device."""
        self.close_all()
        if shape != self.shape:
            self._host = []
            with self.memory.paused():
                self._host = [self.copier.host_empty((shape.num_sub_batches, *shape.block_shape(g)), shape.dtype)
                              for g in range(len(shape.group_layers))]
            self.shape = shape
        largest = max(shape.block_numel(g) for g in range(len(shape.group_layers)))
        self._staging = [self.pool.acquire(largest, shape.dtype) for _ in range(2)]

    def load(self, g: int, i: int, start: int, past: int) -> Pending:
        """Stage block (g, i) on the device with positions start..past-1 loaded: one contiguous copy."""
        buf = self._staging[self._turn]
        self._turn ^= 1
        block = buf[:self.shape.block_numel(g)].view(self.shape.block_shape(g))
        if past <= start:   # nothing to load, but compute must not overwrite what a write-back still reads
            return Pending(block, None if self._last_write is None else self._last_write.event)
        pending = self.copier.to_device(self._host[g][i, start:past], "kv_load_bytes", out=block[start:past],
                                        after=self._last_write)
        return Pending(block, pending.event)

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
