"""Streams and events: what the Copier issues its copies on, CUDA's or the emulated device's.

Every copy goes through the same calls on both: copies go onto side streams, each returns an event, the
compute stream waits on the event before it reads the result, a side stream waits on the compute stream
(or an event) before it overwrites what compute may still read, and a device buffer a side stream uses is
recorded on it (`record`) so it is not reused before that use ends. The emulated device
(sltune.runtime.emulated) plays the same calls on the CPU with copies that complete late, so the tests
check this ordering without a GPU. Selected by SLTUNE_EMULATED_STREAMS; unset, the CPU copies
synchronously and has no streams.
"""

from __future__ import annotations

import contextlib

import torch

ENV = "SLTUNE_EMULATED_STREAMS"


class Event:
    """A point in a stream's work."""

    def query(self) -> bool:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def block_compute(self) -> None:
        """Make the compute stream wait for this point (the host does not wait on CUDA)."""
        raise NotImplementedError


class WorkEvent(Event):
    """The end of an asynchronous collective (a torch.distributed Work handle)."""

    def __init__(self, work):
        self.work = work

    def query(self) -> bool:
        return self.work.is_completed()

    def synchronize(self) -> None:
        self.work.wait()

    def block_compute(self) -> None:
        self.work.wait()      # NCCL: the current stream waits for the collective's; gloo: the host waits


class Streams:
    """What the Copier needs from a device's streams."""

    def stream(self):
        raise NotImplementedError

    def compute(self):
        """The stream the model computes on (torch's current stream on CUDA)."""
        raise NotImplementedError

    def record_event(self, stream) -> Event:
        raise NotImplementedError

    def wait(self, stream, waited) -> None:
        """Work issued on `stream` from now on waits for `waited`: an Event, or a whole stream's work so far."""
        raise NotImplementedError

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor, device_side: torch.Tensor) -> None:
        """dst.copy_(src) issued on `stream`, asynchronous to the host; `device_side` (dst or src) must have
        been recorded on `stream` first."""
        raise NotImplementedError

    def record(self, tensor: torch.Tensor, stream) -> None:
        """`tensor` (device memory) is used by `stream`: do not reuse its memory before that use ends."""
        raise NotImplementedError

    def synchronize(self, stream=None) -> None:
        """Wait on the host for `stream` (None: every stream of the device)."""
        raise NotImplementedError

    def release_fence(self, buf: torch.Tensor) -> list[Event]:
        """When a pooled buffer is given back: events its reuse must wait for (CUDA's allocator does this)."""
        return []

    def issue_after(self, stream, after: Event | None) -> contextlib.AbstractContextManager:
        """Run a collective launched inside this block after `after` (on `stream`). On CUDA the block makes
        `stream` current, so NCCL's stream waits for it; a host-side collective (gloo) reads memory when it
        is launched, so the host waits for `after` first."""
        if after is not None:
            after.synchronize()
        return contextlib.nullcontext()


class CudaEvent(Event):
    def __init__(self, event: "torch.cuda.Event", device: torch.device):
        self.event = event
        self.device = device

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def block_compute(self) -> None:
        # the configured device's stream, never a tensor's device: a device->host result lives on the host
        torch.cuda.current_stream(self.device).wait_event(self.event)


class CudaStreams(Streams):
    def __init__(self, device: torch.device):
        self.device = device

    def stream(self):
        return torch.cuda.Stream(self.device)

    def compute(self):
        return torch.cuda.current_stream(self.device)

    def record_event(self, stream) -> Event:
        event = torch.cuda.Event()
        event.record(stream)
        return CudaEvent(event, self.device)

    def wait(self, stream, waited) -> None:
        if isinstance(waited, CudaEvent):
            stream.wait_event(waited.event)
        else:
            stream.wait_stream(waited)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor, device_side: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def synchronize(self, stream=None) -> None:
        if stream is None:
            torch.cuda.synchronize(self.device)
        else:
            stream.synchronize()

    def issue_after(self, stream, after: Event | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)        # `after` was issued on `stream`: stream order covers it
