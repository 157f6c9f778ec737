"""Where boundary activations (and, on the way back, their gradients) wait between groups.

SpeedLoader runs every sub-batch through a group before the next group, so the activation at each group
edge must wait somewhere for every sub-batch: in host memory, in one preallocated buffer indexed by
(edge, sub-batch). In backward, once a group has fetched its input h[e][i], the slot is free and the
gradient dL/dh[e][i] takes its place, so one buffer serves both directions. The resident and canonical
schedules keep them on the device instead (no traffic, device memory instead).
"""

from __future__ import annotations

import torch

from sltune.runtime.memory import DeviceMemory
from sltune.runtime.transfer import Copier, Pending


class HostActivations:
    """Slots [edge, sub-batch] in one host buffer; each put/fetch is one contiguous copy."""

    def __init__(self, copier: Copier, memory: DeviceMemory):
        self.copier = copier
        self.memory = memory
        self.buffer: torch.Tensor | None = None
        self._written: dict[tuple[int, int], Pending] = {}

    def prepare(self, edges: int, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        want = (edges, n, *shape)
        if self.buffer is None or tuple(self.buffer.shape) != want or self.buffer.dtype != dtype:
            self.buffer = None
            with self.memory.paused():
                self.buffer = self.copier.host_empty(want, dtype)
        self._written.clear()

    def put(self, edge: int, i: int, x: torch.Tensor) -> None:
        self._written[(edge, i)] = self.copier.to_host(x.detach(), self.buffer[edge, i], "act_offload_bytes")

    def fetch(self, edge: int, i: int) -> Pending:
        return self.copier.to_device(self.buffer[edge, i], "act_load_bytes", after=self._written.get((edge, i)))

    def drop(self, edge: int, i: int) -> None:
        """Nothing to free: the slot is reused."""

    def clear(self) -> None:
        self._written.clear()


class DeviceActivations:
    """The same slots, kept on the device: no copies."""

    def __init__(self):
        self._slots: dict[tuple[int, int], torch.Tensor] = {}

    def prepare(self, edges: int, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._slots.clear()

    def put(self, edge: int, i: int, x: torch.Tensor) -> None:
        self._slots[(edge, i)] = x.detach()

    def fetch(self, edge: int, i: int) -> Pending:
        return Pending(self._slots[(edge, i)])

    def drop(self, edge: int, i: int) -> None:
        self._slots.pop((edge, i), None)

    def clear(self) -> None:
        self._slots.clear()
