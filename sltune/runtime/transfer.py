"""Every byte the runtime moves between host and device goes through a Copier, which counts it.

On the CPU a copy is a real memcpy into a separate buffer, done when asked (a "copy ahead" when the
loop asks early). On CUDA copies run on side streams from pinned buffers (pinned at their own size,
sltune.runtime.pinned): parameters on one, activations and KV blocks on another (so this unit's inputs
never queue behind the next unit's parameters), device to host on a third; a Pending's wait() makes the
compute stream wait for it. The emulated device
(sltune.runtime.streams) runs that same stream code on the CPU with copies that complete late.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch

from sltune.runtime.counters import IOCounters
from sltune.runtime.emulated import EmulatedStreams
from sltune.runtime.pinned import CudaPinner, EmulatedPinner, HostMemory
from sltune.runtime.regions import region
from sltune.runtime.streams import ENV, CudaStreams, Event, Streams, WorkEvent


class Pending:
    """A copy that has been issued; wait() returns its destination, ready to use on the device."""

    __slots__ = ("tensor", "event")

    def __init__(self, tensor: torch.Tensor, event: Event | None = None):
        self.tensor = tensor
        self.event = event

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.block_compute()
            self.event = None
        return self.tensor


class Copier:
    """Counts and performs host<->device copies: on streams (CUDA's, or the emulated device's), or plain."""

    def __init__(self, device: torch.device, counters: IOCounters, streams: Streams | None = None):
        self.device = device
        self.counters = counters
        self.cuda = device.type == "cuda"
        self.streams = streams if streams is not None else streams_for(device)
        if self.streams is not None:
            # parameters on a stream of their own: the next unit's load must not delay this one's inputs
            self._params = self.streams.stream()
            self._loads = self.streams.stream()     # activations, their gradients, KV blocks
            self._d2h = self.streams.stream()
        pinner = CudaPinner() if self.cuda else EmulatedPinner() if isinstance(self.streams, EmulatedStreams) else None
        self.host = HostMemory(pinner)
        self._staging: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    @property
    def staging(self) -> list[torch.Tensor]:
        """The host buffers copies are staged through, one per shape and dtype: host memory the copier holds."""
        return list(self._staging.values())

    def host_empty(self, numel_or_shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer: pinned (at its own size) when a device copies from and to it asynchronously."""
        return self.host.empty(numel_or_shape, dtype)

    def to_device(self, src: torch.Tensor, channel: str, out: torch.Tensor | None = None,
                  after: Pending | None = None) -> Pending:
        """Copy a host tensor to the device; `after` is a host write that must land first."""
        self._count(channel, src)
        with region("memcpy", channel):
            if out is None:
                out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            if self.streams is None:
                out.copy_(src)
                return Pending(out)
            streams = self.streams
            stream = self._params if channel == "param_load_bytes" else self._loads
            streams.wait(stream, streams.compute())     # compute may still read what `out` held
            if after is not None and after.event is not None:
                streams.wait(stream, after.event)
            streams.record(out, stream)
            streams.copy(stream, out, src, device_side=out)
            return Pending(out, streams.record_event(stream))

    def to_host(self, src: torch.Tensor, out: torch.Tensor, channel: str, accumulate: bool = False) -> Pending:
        """Copy (or add, for host-side accumulation) a device tensor into a host buffer."""
        self._count(channel, src)
        with region("memcpy", channel):
            if self.streams is None:
                out.add_(src) if accumulate else out.copy_(src)
                return Pending(out)
            streams, stream = self.streams, self._d2h
            streams.wait(stream, streams.compute())     # src is written by compute
            streams.record(src, stream)
            if not accumulate:
                streams.copy(stream, out, src, device_side=src)
                return Pending(out, streams.record_event(stream))
            key = (tuple(out.shape), out.dtype)
            staged = self._staging.get(key)
            if staged is None:                          # pinning costs a system call: once per shape
                staged = self._staging[key] = self.host_empty(out.shape, out.dtype)
            streams.copy(stream, staged, src, device_side=src)
            streams.synchronize(stream)
            out.add_(staged)
            return Pending(out)

    def gather_after(self, copied: Pending, launch: Callable[[torch.Tensor], Any], out: torch.Tensor) -> Pending:
        """Launch an asynchronous collective on a parameter copy once it has landed, without blocking compute
        on CUDA; `launch(src)` returns the Work handle, and the result's wait() waits on it."""
        order = (contextlib.nullcontext() if self.streams is None
                 else self.streams.issue_after(self._params, copied.event))
        with order:
            work = launch(copied.tensor if self.cuda else copied.tensor.clone())   # gloo: not in place
        return Pending(out, WorkEvent(work))

    def synchronize(self) -> None:
        if self.streams is not None:
            self.streams.synchronize()

    def _count(self, channel: str, t: torch.Tensor) -> None:
        setattr(self.counters, channel, getattr(self.counters, channel) + t.numel() * t.element_size())


def streams_for(device: torch.device) -> Streams | None:
    """CUDA streams on a GPU; on the CPU the emulated device when SLTUNE_EMULATED_STREAMS asks for it,
    else None (copies are synchronous memcpy)."""
    if device.type == "cuda":
        return CudaStreams(device)
    mode = os.environ.get(ENV, "").strip().lower()
    if not mode or mode in ("0", "off"):
        return None
    if mode == "lazy":
        return EmulatedStreams()
    try:
        delay_ms = float(mode)
    except ValueError:
        raise ValueError(f"{ENV}={mode!r}: use 'lazy' or a delay in milliseconds") from None
    return EmulatedStreams(delay=delay_ms / 1000)
