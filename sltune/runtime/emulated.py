"""The emulated asynchronous device: CUDA's stream semantics on the CPU, with copies that complete late.

Each side stream is a worker thread over a queue. A queued copy runs only when something orders it (an
event wait, a stream waiting on it, a synchronize) or, with a delay, once that delay has passed: so by
default every copy completes as late as the ordering allows, and a missing wait shows up as wrong numbers
in the tests instead of as a rare race on a GPU. Compute is the caller's thread (the CPU runs it
synchronously), so hazards where compute finishes late are the one kind it cannot show. `record` is
enforced: a copy whose device-side tensor was not recorded on its stream is refused, and a pooled buffer
released while a stream still uses it is handed out again only after that use completes.

SLTUNE_EMULATED_STREAMS=lazy (as late as the ordering allows) or a delay in milliseconds selects it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Callable

import torch

from sltune.runtime.streams import Event, Streams


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
        stream.enqueue(lambda: _copy(dst, src))

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


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A device copy is not an autograd op (the worker thread's grad mode is on, as every new thread's is)."""
    with torch.no_grad():
        dst.copy_(src)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _close_all(streams: list[_EmuStream]) -> None:
    for s in streams:
        s.close()
