"""Device memory: measured peaks and the enforced limit, on CUDA and on the CPU.

On CUDA the caching allocator enforces a limit (per-process memory fraction) on the memory it reserves,
and the peak is read on that same figure (max_memory_reserved). On the CPU the "device" is host memory,
so the runtime measures what a step allocates itself: a TorchDispatchMode sees every ATen op, counts
the storages each op freshly allocates (outputs the op's schema does not mark as aliases of its inputs)
until they are freed, and adds the runtime's own device buffers explicitly. Host-side work (host buffers, the
optimizer on host parameters) runs paused, so the figure is "what a step allocates above its host-resident buffers".
The tracker costs about 25 us per op, so by default it runs on the first step of each batch shape:
the peak is a function of the shapes and the config.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sltune.sizes import format_bytes, parse_bytes


class DeviceMemoryExceeded(torch.OutOfMemoryError):
    """A step needed more device memory than the limit allows; the engine is left as it was."""

    def __init__(self, peak_bytes: int, limit_bytes: int, device: str = "cpu"):
        self.peak_bytes = int(peak_bytes)
        self.limit_bytes = int(limit_bytes)
        super().__init__(
            f"device memory limit exceeded on {device}: the step reached {format_bytes(peak_bytes)} "
            f"({peak_bytes} bytes) against a limit of {format_bytes(limit_bytes)} ({limit_bytes} bytes). "
            "Lower sub_batch_size or num_live_blocks, or raise device_memory_limit."
        )

    def __reduce__(self):  # picklable across trial processes
        return (type(self), (self.peak_bytes, self.limit_bytes))


class DeviceMemory:
    """What every device memory monitor offers the engine."""

    limit: int | None = None
    peak: int = 0

    def tracking(self, active: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def paused(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def alloc(self, nbytes: int) -> None:
        pass

    def free(self, nbytes: int) -> None:
        pass


class CpuAllocationTracker(DeviceMemory, TorchDispatchMode):
    """Counts live bytes of storages allocated by ATen ops (and explicit buffers); keeps the peak."""

    def __init__(self, limit: int | None = None, device: str = "cpu"):
        TorchDispatchMode.__init__(self)
        self.limit = limit
        self.device = device
        self.live = 0
        self.peak = 0
        self._counting = False
        self._refs: dict[int, weakref.ref] = {}
        self._fresh: dict[object, tuple[int, ...] | None] = {}

    # -- explicit buffers (the runtime's pool) -------------------------------------------------
    def alloc(self, nbytes: int) -> None:
        """Count an explicit buffer; over the limit nothing is counted and DeviceMemoryExceeded is raised."""
        if self._counting and self.limit is not None and self.live + nbytes > self.limit:
            self.peak = max(self.peak, self.live + nbytes)
            raise DeviceMemoryExceeded(self.live + nbytes, self.limit, self.device)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def free(self, nbytes: int) -> None:
        self.live -= nbytes

    # -- the step window -----------------------------------------------------------------------
    @contextlib.contextmanager
    def tracking(self, active: bool) -> Iterator[None]:
        if not active:
            yield
            return
        self.peak = self.live
        self._counting = True
        try:
            with self:
                yield
        finally:
            self._counting = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        was, self._counting = self._counting, False
        try:
            yield
        finally:
            self._counting = was

    def _check(self) -> None:
        if self.live > self.peak:
            self.peak = self.live
            if self._counting and self.limit is not None and self.live > self.limit:
                raise DeviceMemoryExceeded(self.live, self.limit, self.device)

    def _released(self, key: int, nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= nbytes

    def _fresh_outputs(self, func) -> tuple[int, ...] | None:
        """Indices of the op's outputs that are new allocations (not aliases of inputs)."""
        try:
            return self._fresh[func]
        except KeyError:
            idx = tuple(i for i, r in enumerate(func._schema.returns)
                        if r.alias_info is None and ("Tensor" in str(r.type)))
            self._fresh[func] = idx or None
            return self._fresh[func]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._counting:
            return out
        fresh = self._fresh_outputs(func)
        if fresh is None:
            return out
        outs = out if isinstance(out, (tuple, list)) and len(func._schema.returns) > 1 else (out,)
        for i in fresh:
            o = outs[i]
            for t in (o if isinstance(o, (list, tuple)) else (o,)):
                if isinstance(t, torch.Tensor):
                    self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        if t.is_sparse:         # the input embedding's gradient in rows (sltune.runtime.rowgrads)
            for part in (t._indices(), t._values()):
                self._count(part)
            return
        st = t.untyped_storage()
        nbytes, key = st.nbytes(), self._key(st)
        if nbytes == 0 or key in self._refs:
            return
        self._refs[key] = weakref.ref(st, lambda _r, k=key, n=nbytes: self._released(k, n))
        self.live += nbytes
        self._check()

    @staticmethod
    def _key(st: torch.UntypedStorage) -> int:
        return st.data_ptr()


class CudaAllocator:
    """The few facts and controls of torch's CUDA caching allocator the monitor uses (a seam: the CPU tests
    run the monitor's logic against a model of the allocator)."""

    total_memory = staticmethod(lambda device: torch.cuda.get_device_properties(device).total_memory)
    set_fraction = staticmethod(torch.cuda.set_per_process_memory_fraction)
    reset_peak = staticmethod(torch.cuda.reset_peak_memory_stats)
    max_reserved = staticmethod(torch.cuda.max_memory_reserved)


class CudaMemoryMonitor(DeviceMemory):
    """The limit is a per-process memory fraction, which the allocator applies to *reserved* memory (what it
    holds from the driver, fragmentation and cached blocks included); so the peak is measured on the same
    figure, max_memory_reserved, and a step that hits the limit reports what was reserved. A limit set back
    to None gives the whole device back (the fraction is per process and outlives the engine)."""

    def __init__(self, device: torch.device, limit: int | None = None, allocator=CudaAllocator):
        self.device = device
        self.limit = limit
        self.allocator = allocator
        total = allocator.total_memory(device)
        allocator.set_fraction(1.0 if limit is None else min(1.0, limit / total), device)

    @contextlib.contextmanager
    def tracking(self, active: bool) -> Iterator[None]:
        self.allocator.reset_peak(self.device)
        try:
            yield
        except torch.OutOfMemoryError as err:
            if self.limit is None or isinstance(err, DeviceMemoryExceeded):
                raise
            need = oom_need(str(err), self.allocator.max_reserved(self.device))
            raise DeviceMemoryExceeded(need, self.limit, str(self.device)) from None
        finally:
            self.peak = self.allocator.max_reserved(self.device)
        if self.limit is not None and self.peak > self.limit:
            raise DeviceMemoryExceeded(self.peak, self.limit, str(self.device))


_REQUEST = re.compile(r"Tried to allocate ([0-9.]+ ?[KMGT]?i?B)")


def oom_need(message: str, reserved: int) -> int:
    """What a step that ran out of CUDA memory needed: what was reserved plus the request that failed (from
    the allocator's message), the figure the limit applies to."""
    match = _REQUEST.search(message)
    return reserved + (parse_bytes(match.group(1)) if match else 0)


def monitor_for(device: torch.device, limit: int | None) -> DeviceMemory:
    if device.type == "cuda":
        return CudaMemoryMonitor(device, limit)
    return CpuAllocationTracker(limit, str(device))
