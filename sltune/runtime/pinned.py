"""Host buffers the device copies from and to: page-locked at their own size.

`torch.empty(..., pin_memory=True)` goes through PyTorch's caching host allocator, which rounds every block
up to a power of two: a 1.1 GiB parameter buffer pins 2 GiB, and the host peak a trial reports inflates
with it. Here a buffer is ordinary pageable memory, page-aligned, whose own pages are then page-locked
(cudaHostRegister) and unlocked when the last tensor viewing it is gone. The bytes pinned are counted,
live and peak, so what the runtime pins is a measured figure.

On the emulated device the registration is played by a recorder that enforces CUDA's rule that a range
is registered once, so the allocation logic runs in the CPU tests.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

PAGE = 4096
IN_PLACE_FROM = 1 << 20     # smaller buffers (per-layer saved tensors, say) come from torch's pinned allocator:
                            # its rounding costs under 1 MiB each, a system call per buffer would cost more


class CudaPinner:
    """Page-locks host memory in place with the CUDA runtime."""

    def register(self, ptr: int, nbytes: int) -> None:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")

    def unregister(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


class EmulatedPinner:
    """The emulated device's page-locking: records the ranges and refuses overlaps, as CUDA does."""

    def __init__(self):
        self.ranges: dict[int, int] = {}
        self._lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            for start, size in self.ranges.items():
                if ptr < start + size and start < ptr + nbytes:
                    raise RuntimeError(f"host range {ptr:#x}+{nbytes} overlaps one already registered")
            self.ranges[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        with self._lock:
            del self.ranges[ptr]


class HostMemory:
    """Allocates host buffers, pinned at their page-rounded size when a pinner is given (from 1 MiB on)."""

    def __init__(self, pinner: CudaPinner | EmulatedPinner | None = None):
        self.pinner = pinner
        self.pinned_bytes = 0
        self.peak_pinned_bytes = 0
        self._lock = threading.Lock()

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self.pinner is None or nbytes < IN_PLACE_FROM:
            return torch.empty(shape, dtype=dtype, pin_memory=isinstance(self.pinner, CudaPinner))
        span = max(PAGE, -(-nbytes // PAGE) * PAGE)             # whole pages of its own
        raw = torch.empty(span + PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE
        pages = raw[start:start + span]
        ptr = pages.data_ptr()
        self.pinner.register(ptr, span)
        with self._lock:
            self.pinned_bytes += span
            self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)
        weakref.finalize(raw.untyped_storage(), self._unpin, ptr, span)   # when the last view is gone
        return pages[:nbytes].view(dtype).view(shape)

    def _unpin(self, ptr: int, span: int) -> None:
        self.pinner.unregister(ptr)
        with self._lock:
            self.pinned_bytes -= span
