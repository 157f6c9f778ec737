"""A unit's gradients in host memory only from their offload to their step (`param_offload: disk`).

With the weights, the masters and the optimizer state in files, the gradients were the last thing held whole in
host memory: 4 bytes a parameter under a float32 master, more than the bfloat16 weights themselves. Yet a unit's
gradient sum is needed only from the moment the backward offloads it to the moment its optimizer step has read
it. So each unit borrows a page-aligned buffer when its gradients are offloaded and gives it back once it has
stepped; the buffers held and kept for reuse stay within a budget, the SLOTS largest units' gradients together, and
the backward waits while the next unit's would not fit. Host memory holds two units' gradients, not the model's
(a budget of the two largest, not two buffers the size of the largest: a tied embedding is often several layers' size).
Between steps it keeps none: the forward needs no gradient buffer, and kept ones sat on the host's peak at the
turnaround, where the activations peak. Measured on qwen2-0.5b (bf16, both on disk, b=2 N=4 seq 256, two rounds
interleaved): 3.27-3.28 GiB at the peak against 3.83-3.99 GiB keeping them, step times within noise (23.9-26.0 s
against 22.9-24.2 s); the optimizer's views of a buffer go with it (`bind(unit, None)`), or they would keep it alive.

When the step must see every gradient first (clipping on the global norm, float16's overflow check: a deferred
step, sltune.runtime.stepping) a unit's gradients are spilled instead: written to a file of the engine's folder
(checksummed), and the buffer returned; after the backward the step reads them back one unit ahead, scales them by
the clipping and unscaling coefficient, and steps. Either way each unit's squared norm is taken as its gradients
arrive and summed in the units' own order, so the norm, the clipping and the steps equal the whole-buffer ones to
the bit.

Sharded over ranks (sltune.runtime.sharding) the same: each rank's window lends buffers for its gradient shards, from
their reduce-scatter and offload to their step, and each rank's squares are summed over the ranks as a whole
buffer's are.
"""

from __future__ import annotations

import errno
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from sltune.runtime.disk import checksum
from sltune.runtime.counters import IOCounters
from sltune.runtime.disk.direct_io import DirectFiles, aligned_empty
from sltune.runtime.disk.layout import padded
from sltune.runtime.precision import square_of, squared_norm
from sltune.runtime.disk.files import IntegrityError
from sltune.runtime.disk.folder import safe_name

SLOTS = 2       # units held at once, at least: one stepping (or spilling) while the backward offloads the next


def budget(grad_bytes: Sequence[int]) -> int:
    """The window's bytes for units whose gradients take these bytes: the SLOTS largest, padded to pages (the
    tuner's prior counts the same, sltune.tuning.cost.prior)."""
    return sum(sorted((padded(n) for n in grad_bytes), reverse=True)[:SLOTS])


class GradWindow:
    """Host buffers the units' gradient sums borrow between their offload and their step, within a budget, and the
    files a deferred step spills them to."""

    def __init__(self, units: Sequence[Any], dtype: torch.dtype, files: DirectFiles, folder: Path,
                 counters: IOCounters, lock: threading.Condition, bind: Callable[[Any, torch.Tensor | None], None],
                 numel: Callable[[Any], int] | None = None):
        """`units`: those with gradients (their sizes, `numel`, make the budget); `dtype`: the gradient sums' (float32
        under a master); `files`, `folder`, `counters`, `lock`: the disk tier's, whose folder the spill shares;
        `bind(unit, flat)`: points the optimizer's view of a unit's gradients at the buffer it borrowed (None: at
        nothing, once the step is over); `numel(unit)`:
        how many gradient values a unit offloads here (default its grad_numel; sharded, this rank's share)."""
        self.dtype = dtype
        # weakly: the store holding this window gives its own method, and a cycle would keep the engine (and its
        # folder on disk) alive until a garbage collection, which a process may never run before it exits
        self._bind = weakref.WeakMethod(bind) if hasattr(bind, "__self__") else lambda: bind
        self.numel = numel or (lambda unit: unit.grad_numel)
        self.budget = budget([self.numel(u) * dtype.itemsize for u in units])
        self.files, self.folder, self.counters, self._io_lock = files, folder, counters, lock
        self._index = {id(u): i for i, u in enumerate(units)}
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []                        # kept for reuse, smallest first
        self._held: dict[int, torch.Tensor] = {}                  # unit id -> its buffer
        self._bound: dict[int, Any] = {}                           # units whose views point into a buffer
        self._error: BaseException | None = None
        self.squares: dict[int, torch.Tensor] = {}                 # unit id -> squared norm (float64), this step's
        self._spilled: dict[int, tuple[Path, int, int]] = {}       # unit id -> (file, payload bytes, checksum)
        self._reads: dict[int, Future] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="sltune-grads-read")
        self.peak_bytes = 0

    # -- the buffers -------------------------------------------------------------------------------------
    def _bytes(self) -> int:
        return sum(b.numel() for b in self._held.values()) + sum(b.numel() for b in self._free)

    @property
    def held_bytes(self) -> int:
        """Host memory the window holds now: lent buffers and those kept for reuse (none between steps)."""
        with self._cond:
            return self._bytes()

    def acquire(self, unit: Any) -> torch.Tensor:
        """The unit's flat gradient buffer: a kept one that holds it, else a new one once it fits in the budget
        (kept ones too small are dropped first); waits while the units held leave no room (the step is behind)."""
        need = padded(self.numel(unit) * self.dtype.itemsize)
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"the gradients of {unit.name} found no host buffer: the optimizer step "
                                       f"before them failed ({self._error})") from self._error
                fits = next((i for i, b in enumerate(self._free) if b.numel() >= need), None)
                buf = None if fits is None else self._free.pop(fits)
                if buf is not None:
                    break
                while self._free and self._bytes() + need > self.budget:
                    self._free.pop()
                if self._bytes() + need <= self.budget:
                    break
                self._cond.wait()
            self._held[id(unit)] = buf if buf is not None else aligned_empty(need)
            self.peak_bytes = max(self.peak_bytes, self._bytes())
        flat = self.typed(unit)
        self._bind()(unit, flat)
        self._bound[id(unit)] = unit
        return flat

    def typed(self, unit: Any) -> torch.Tensor:
        """The unit's gradients in its buffer, flat, in the gradients' dtype."""
        return self._held[id(unit)][:self.numel(unit) * self.dtype.itemsize].view(self.dtype)

    def release(self, unit: Any) -> None:
        """The unit has stepped (or spilled): its buffer is kept for the next."""
        with self._cond:
            buf = self._held.pop(id(unit), None)
            if buf is not None:
                self._free.append(buf)
                self._free.sort(key=lambda b: b.numel())
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The stepping failed: whoever waits for a buffer raises instead of waiting forever."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    # -- the norm ----------------------------------------------------------------------------------------
    def begin(self) -> None:
        """A step starts: no squares yet."""
        self.squares = {}

    def account(self, unit: Any) -> None:
        """The squared norm of the unit's gradients, as finish_grads takes it of a whole buffer."""
        self.squares[id(unit)] = square_of(self.typed(unit))

    def square(self, units: Sequence[Any]) -> torch.Tensor:
        """The squared global norm, summed in `units`' order (the whole-buffer sum's order: the same float64)."""
        return squared_norm(self.squares[id(u)] for u in units if id(u) in self.squares)

    # -- the spill (a deferred step) ---------------------------------------------------------------------
    def spill(self, unit: Any) -> None:
        """Write the unit's gradients to its file and give the buffer back (the stepping thread's)."""
        nbytes = self.numel(unit) * self.dtype.itemsize
        buf = self._held[id(unit)]
        path = self.folder / f"g{self._index[id(unit)]:04d}-{safe_name(unit.name)}.bin"
        digest = checksum.ONE_SHOT[checksum.NAME](buf[:nbytes].numpy())
        moved = self.files.write(path, buf, nbytes)
        with self._io_lock:
            self.counters.disk_write_bytes += moved
        self._spilled[id(unit)] = (path, nbytes, digest)
        self.release(unit)

    def request(self, unit: Any) -> None:
        """Start reading a spilled unit's gradients back into a buffer (the reader waits for room)."""
        if id(unit) in self._spilled and id(unit) not in self._reads:
            self._reads[id(unit)] = self._reader.submit(self._read_back, unit)

    def restore(self, unit: Any) -> torch.Tensor:
        """The spilled unit's gradients, back in a buffer."""
        self.request(unit)
        self._reads.pop(id(unit)).result()
        return self.typed(unit)

    def _read_back(self, unit: Any) -> None:
        path, nbytes, digest = self._spilled[id(unit)]
        self.acquire(unit)
        buf = self._held[id(unit)]
        try:
            moved = self.files.read(path, buf, nbytes)
        except OSError as err:
            self.release(unit)
            why = "it ends early" if err.errno == errno.EIO else err.strerror or str(err)
            raise IntegrityError(f"{path}: the spilled gradients of {unit.name} are unreadable ({why}): a file "
                                 "under offload_dir removed or truncated during the step") from None
        got = checksum.ONE_SHOT[checksum.NAME](buf[:nbytes].numpy())
        if got != digest:
            self.release(unit)
            raise IntegrityError(f"{path}: checksum mismatch in the spilled gradients of {unit.name}: the file "
                                 "changed during the step (damaged storage or another writer)")
        with self._io_lock:
            self.counters.disk_read_bytes += moved

    def reset(self) -> None:
        """Between steps (after a commit, a skip or a failure): every buffer given back to the system, no spill
        files, no error."""
        self.fail(RuntimeError("the step ended"))      # a read-back waiting for room gives up
        for fut in self._reads.values():
            try:
                fut.result()
            except BaseException:       # noqa: BLE001 - the step is over either way
                pass
        for path, _, _ in self._spilled.values():
            path.unlink(missing_ok=True)
        self._reads, self._spilled = {}, {}         # the squares stay: the step's norm is read after
        for unit in self._bound.values():      # the optimizer's views would keep the buffers alive
            self._bind()(unit, None)
        self._bound = {}
        with self._cond:        # the forward needs none: kept, they would sit on the host's peak at the turnaround
            self._free = []
            self._held.clear()
            self._error = None

    def close(self) -> None:
        self._reader.shutdown(wait=True)
