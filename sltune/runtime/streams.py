"""Streams and events: CUDA's, or an emulated asynchronous device that proves their ordering on the CPU.

The Copier issues every copy through one of these, with the same calls on both: copies go onto side
streams, each returns an event, the compute stream waits on the event before it reads the result, a side
stream waits on the compute stream (or an event) before it overwrites what compute may still read, and a
device buffer a side stream uses is recorded on it (`record`) so it is not reused before that use ends.

`EmulatedStreams` runs each side stream as a worker thread over a queue. A queued copy runs only when
something orders it (an event wait, a stream waiting on it, a synchronize) or, with a delay, once that
delay has passed: so by default every copy completes as late as the ordering allows, and a missing wait
shows up as wrong numbers instead of as a rare race on a GPU. Compute is the caller's thread (the CPU
runs it synchronously), so hazards where compute finishes late are the one kind it cannot show.
`record` is enforced: a copy whose device-side tensor was not recorded on its stream is refused, and a
pooled buffer released while a stream still uses it is handed out again only after that use completes.

Selected by the environment: SLTUNE_EMULATED_STREAMS=lazy (as late as the ordering allows) or a delay in
milliseconds (each copy may start that long after it is issued). Unset, the CPU copies synchronously.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import deque
from typing import Callable

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


# -- the emulated device -------------------------------------------------------------------------------
class _EmuStream:
    """A queue of work run in order by a worker thread, each item when demanded (or after `delay`)."""

    def __init__(self, name: str, delay: float | None):
        self.name = name
        self.delay = delay
        self._ops: deque[tuple[int, Callable[[], None], float]] = deque()
        self.issued = 0                 # sequence number of the last queued op
        self.done = 0                   # ... of the last completed one
        self._demand = 0
        self._error: BaseException | None = None
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"sltune-emu-{name}", daemon=True)
        self._thread.start()

    def enqueue(self, fn: Callable[[], None]) -> int:
        with self._cv:
            self.issued += 1
            self._ops.append((self.issued, fn, time.monotonic()))
            self._cv.notify_all()
            return self.issued

    def wait_for(self, seq: int) -> None:
        """Demand the work up to `seq` and block until it is done (re-raising what it raised)."""
        with self._cv:
            self._demand = max(self._demand, seq)
            self._cv.notify_all()
            while self.done < seq and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise RuntimeError(f"emulated stream {self.name} failed") from self._error

    def close(self) -> None:
        """Finish the queued work and end the thread (before the interpreter tears torch down)."""
        with self._cv:
            self._closed = True
            self._demand = self.issued
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _next(self) -> tuple[int, Callable[[], None]] | None:
        with self._cv:
            while True:
                if self._ops:
                    seq, fn, issued_at = self._ops[0]
                    wait = None if self.delay is None else issued_at + self.delay - time.monotonic()
                    if self._demand >= seq or (wait is not None and wait <= 0):
                        self._ops.popleft()
                        return seq, fn
                elif self._closed:
                    return None
                else:
                    wait = None
                self._cv.wait(wait)

    def _run(self) -> None:
        while (item := self._next()) is not None:
            seq, fn = item
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on this stream
                with self._cv:
                    self._error = err
            with self._cv:
                self.done = seq
                self._cv.notify_all()


class _EmuCompute:
    """The compute stream of the emulated device: the caller's thread, so its work is done when issued."""

    name = "compute"


class EmuEvent(Event):
    def __init__(self, stream: _EmuStream | None, seq: int):
        self.stream = stream
        self.seq = seq

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.seq

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.wait_for(self.seq)

    def block_compute(self) -> None:
        self.synchronize()        # compute is the host thread: waiting for the event is blocking it


class EmulatedStreams(Streams):
    """Side streams as worker threads whose copies complete late unless an event or wait orders them."""

    def __init__(self, delay: float | None = None):
        self.delay = delay
        self._compute = _EmuCompute()
        self._streams: list[_EmuStream] = []
        self._used: dict[int, set[_EmuStream]] = {}       # storage pointer -> streams recorded on it
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._streams)

    def stream(self) -> _EmuStream:
        s = _EmuStream(f"side{len(self._streams)}", self.delay)
        self._streams.append(s)
        return s

    def compute(self) -> _EmuCompute:
        return self._compute

    def record_event(self, stream) -> EmuEvent:
        if stream is self._compute:
            return EmuEvent(None, 0)
        return EmuEvent(stream, stream.issued)

    def wait(self, stream, waited) -> None:
        if not isinstance(waited, EmuEvent):
            waited = self.record_event(waited)
        if stream is self._compute:
            waited.synchronize()
        elif waited.stream is not None and waited.stream is not stream:
            stream.enqueue(waited.synchronize)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor, device_side: torch.Tensor) -> None:
        with self._lock:
            recorded = stream in self._used.get(_key(device_side), ())
        if not recorded:
            raise RuntimeError(f"a device tensor is used on emulated stream {stream.name} without record(tensor, "
                               "stream): its memory could be reused while the copy still runs")
        stream.enqueue(lambda: dst.copy_(src))

    def record(self, tensor: torch.Tensor, stream) -> None:
        with self._lock:
            self._used.setdefault(_key(tensor), set()).add(stream)

    def synchronize(self, stream=None) -> None:
        for s in [stream] if stream is not None else list(self._streams):
            if s is not self._compute:
                s.wait_for(s.issued)
        if stream is None:
            with self._lock:        # nothing is in flight: no recorded use is left
                self._used.clear()

    def release_fence(self, buf: torch.Tensor) -> list[Event]:
        with self._lock:
            users = self._used.pop(_key(buf), set())
        return [self.record_event(s) for s in users]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _close_all(streams: list[_EmuStream]) -> None:
    for s in streams:
        s.close()


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
        return EmulatedStreams(delay=float(mode) / 1000)
    except ValueError:
        raise ValueError(f"{ENV}={mode!r}: use 'lazy' or a delay in milliseconds") from None
