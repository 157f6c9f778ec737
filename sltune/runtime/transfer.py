"""Every byte the runtime moves between host and device goes through a Copier, which counts it.

On the CPU a copy is a real memcpy into a separate buffer, done when asked (a "copy ahead" when the
loop asks early). On CUDA copies run on side streams from pinned buffers; a Pending's wait() makes the
compute stream wait for it. Both behave the same to the schedules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from sltune.runtime.regions import region


@dataclass
class IOCounters:
    """Bytes moved per channel. The collective channels count what this rank hands to collectives."""

    param_load_bytes: int = 0       # host -> device parameter copies (or all-gathered shards)
    grad_offload_bytes: int = 0     # device -> host gradient copies (or reduce-scattered)
    act_offload_bytes: int = 0      # device -> host boundary activations and their gradients
    act_load_bytes: int = 0         # host -> device boundary activations and their gradients
    allgather_bytes: int = 0        # parameters handed to all-gather
    reduce_scatter_bytes: int = 0   # gradients handed to reduce-scatter
    kv_load_bytes: int = 0          # host -> device KV cache (generation)
    kv_offload_bytes: int = 0       # device -> host KV cache (generation)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __add__(self, other: "IOCounters") -> "IOCounters":
        return IOCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: "IOCounters") -> "IOCounters":
        return IOCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def copy(self) -> "IOCounters":
        return IOCounters(**self.as_dict())


class Pending:
    """A copy that has been issued; wait() returns its destination, ready to use on the device."""

    __slots__ = ("tensor", "event")

    def __init__(self, tensor: torch.Tensor, event=None):
        self.tensor = tensor
        self.event = event

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.event)
            self.event = None
        return self.tensor


class Copier:
    """Counts and performs host<->device copies; CUDA gets streams, the CPU plain copies."""

    def __init__(self, device: torch.device, counters: IOCounters):
        self.device = device
        self.counters = counters
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._h2d = torch.cuda.Stream(device)
            self._d2h = torch.cuda.Stream(device)

    def host_empty(self, numel_or_shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer: pinned when a CUDA device will read it."""
        return torch.empty(numel_or_shape, dtype=dtype, pin_memory=self.cuda)

    def to_device(self, src: torch.Tensor, channel: str, out: torch.Tensor | None = None,
                  after: Pending | None = None) -> Pending:
        """Copy a host tensor to the device; `after` is a host write that must land first."""
        self._count(channel, src)
        with region("memcpy", channel):
            if out is None:
                out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            if not self.cuda:
                out.copy_(src)
                return Pending(out)
            return self._h2d_copy(src, out, after)

    def _h2d_copy(self, src: torch.Tensor, out: torch.Tensor, after: Pending | None) -> Pending:
        stream = self._h2d
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None and after.event is not None:
            stream.wait_event(after.event)
        with torch.cuda.stream(stream):
            out.copy_(src, non_blocking=True)
            out.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return Pending(out, event)

    def to_host(self, src: torch.Tensor, out: torch.Tensor, channel: str, accumulate: bool = False) -> Pending:
        """Copy (or add, for host-side accumulation) a device tensor into a host buffer."""
        self._count(channel, src)
        with region("memcpy", channel):
            if not self.cuda:
                out.add_(src) if accumulate else out.copy_(src)
                return Pending(out)
            return self._d2h_copy(src, out, accumulate)

    def _d2h_copy(self, src: torch.Tensor, out: torch.Tensor, accumulate: bool) -> Pending:
        stream = self._d2h
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            src.record_stream(stream)
            if accumulate:
                staged = torch.empty_like(out, pin_memory=True)
                staged.copy_(src, non_blocking=True)
                stream.synchronize()
                out.add_(staged)
            else:
                out.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return Pending(out, event)

    def synchronize(self) -> None:
        if self.cuda:
            self._h2d.synchronize()
            self._d2h.synchronize()
            torch.cuda.synchronize(self.device)

    def _count(self, channel: str, t: torch.Tensor) -> None:
        setattr(self.counters, channel, getattr(self.counters, channel) + t.numel() * t.element_size())
