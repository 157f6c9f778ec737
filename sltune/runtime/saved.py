"""A unit's forward kept for its backward: autograd's saved tensors held aside, so nothing is recomputed.

`activations: offload` runs each group's forward with autograd once per sub-batch and keeps the graph until
that group's backward, phases later. Two things would otherwise pin device memory for every sub-batch:

- the tensors autograd saves (torch.autograd.graph.saved_tensors_hooks): packed into host memory, back
  to back in one slab per dtype reused from step to step, and loaded back, one copy per slab into a
  pooled device buffer, for the sub-batch about to run its backward (one sub-batch ahead). Parameters
  are not saved at all: a saved tensor that lives in a live unit's device buffer is packed as (unit, offset,
  shape, stride) and re-bound to the unit's buffer of the backward phase, which holds the same values (the optimizer
  steps only after the whole pass);
- the group's input and output: `KeptGraph` wraps them in two small autograd functions, so the graph
  runs from a zero-size root and hands back the input's gradient without holding either tensor.

With `host=False` (the canonical schedule, and the embedding's few index tensors under `recompute`) the
saved tensors stay where autograd put them, parameters still re-bound.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from sltune.runtime.memory import DeviceMemory
from sltune.runtime.params import BufferPool, ParamUnit
from sltune.runtime.transfer import Copier, Pending


@dataclass(frozen=True)
class _ParamRef:
    unit: ParamUnit
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


class _Packed:
    """Where a saved tensor went: a slab of its key, at an offset, dense; on the device once unpacked."""

    __slots__ = ("key", "slot", "start", "shape", "stride", "tensor")

    def __init__(self, key: Any, slot: int, start: int, shape: torch.Size, stride: tuple[int, ...]):
        self.key, self.slot, self.start, self.shape, self.stride = key, slot, start, shape, stride
        self.tensor: torch.Tensor | None = None


def _dense_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class SavedTensors:
    """Autograd's saved tensors per (unit, sub-batch) key, in host memory or left on the device.

    In host memory a key's tensors are packed back to back into one slab per dtype, sized by what the key
    packed on the previous step, so its backward loads them with one copy per dtype into a pooled device
    buffer. A llama layer saves some twenty tensors per sub-batch, tens of KiB each at b=1: on a GPU one
    copy per tensor is one small transfer each, far from the link's bandwidth, and a fresh allocation each.
    On the CPU it measured the same as a copy per tensor (per layer and sub-batch at b=1 s=32: 1.5 ms of
    hooks, graph and copies over plain autograd's 11.7 ms, either way). A key whose layout is not known
    yet (its first step, a new shape) gets a slab per tensor."""

    def __init__(self, copier: Copier, memory: DeviceMemory, pool: BufferPool, host: bool):
        self.copier = copier
        self.memory = memory
        self.pool = pool
        self.host = host
        self._bundles: dict[Any, _Bundle] = {}
        self._loaded: dict[Any, list[Pending]] = {}
        self._slabs: dict[Any, dict[tuple[torch.dtype, int], list[torch.Tensor]]] = {}  # host, reused
        self._layout: dict[Any, dict[torch.dtype, int]] = {}   # numel packed per dtype, by key, last time
        self.nbytes: dict[Any, int] = {}                        # bytes packed to host per key, this step

    @contextlib.contextmanager
    def keeping(self, key: Any, units: tuple[ParamUnit, ...]) -> Iterator[None]:
        """Run a forward whose saved tensors are held under `key` until `release(key)`."""
        live = {u.dev.untyped_storage().data_ptr(): u for u in units if u.dev is not None}
        bundle = self._bundles[key] = _Bundle(dict(self._layout.get(key, {})), self._spare(key))
        self.nbytes[key] = 0
        seen: dict[tuple, tuple[torch.Tensor, Any]] = {}     # one copy of a tensor saved by several ops

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            unit = live.get(storage.data_ptr())
            if unit is not None:
                return _ParamRef(unit, t.storage_offset() - unit.dev.storage_offset(), t.shape, t.stride())
            if not self.host:
                return t
            sig = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            hit = seen.get(sig)
            if hit is not None:
                return hit[1]
            slot, start = self._place(bundle, t)
            handle = _Packed(key, slot, start, t.shape, _dense_strides(t.shape))
            dst = bundle.slabs[slot].as_strided(handle.shape, handle.stride, start)
            bundle.written[slot] = self.copier.to_host(t, dst, "act_offload_bytes")
            self.nbytes[key] += t.numel() * t.element_size()
            seen[sig] = (t, handle)         # holding t keeps its storage from being reused under the same key
            return handle

        def unpack(packed):
            if isinstance(packed, _ParamRef):
                return packed.unit.dev.as_strided(packed.shape, packed.stride,
                                                  packed.unit.dev.storage_offset() + packed.offset)
            if isinstance(packed, torch.Tensor):
                return packed
            if packed.tensor is None:       # a tensor several ops saved is unpacked once
                if packed.key not in self._loaded:
                    self.prefetch(packed.key)
                slab = self._loaded[packed.key][packed.slot].wait()
                packed.tensor = slab.as_strided(packed.shape, packed.stride, packed.start)
            return packed.tensor

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            seen.clear()
            self._layout[key] = bundle.packed

    def _place(self, bundle: "_Bundle", t: torch.Tensor) -> tuple[int, int]:
        """The slab (index into bundle.slabs) and offset where t goes: the dtype's open slab if it has room,
        else a new one, as large as last step's layout says is still to come (exactly t, without one)."""
        numel, dtype = t.numel(), t.dtype
        slot = bundle.open.get(dtype)
        if slot is not None and bundle.used[slot] + numel <= bundle.slabs[slot].numel():
            start = bundle.used[slot]
        else:
            left = bundle.planned.get(dtype, 0) - bundle.packed.get(dtype, 0)
            size = left if left >= numel else numel
            slab = bundle.reuse(dtype, size)
            if slab is None:
                bundle.drop_spares(dtype)       # last step's slabs of this dtype go before the new one comes
                slab = self._host_empty(size, dtype)
            slot, start = bundle.add(slab), 0
        bundle.used[slot] = start + numel
        bundle.packed[dtype] = bundle.packed.get(dtype, 0) + numel
        return slot, start

    def _host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self.memory.paused():
            return self.copier.host_empty(numel, dtype)

    def _spare(self, key: Any) -> dict[tuple[torch.dtype, int], list[torch.Tensor]]:
        """The key's host slabs from earlier steps, by (dtype, size), to be reused; what this step does not
        reuse is dropped when it packs anew."""
        spare = self._slabs.get(key, {})
        self._slabs[key] = {}
        return spare

    def prefetch(self, key: Any) -> None:
        """Start loading a key's saved tensors back to the device (before its backward needs them)."""
        if key in self._loaded or key not in self._bundles:
            return
        bundle = self._bundles[key]
        loaded = self._loaded[key] = []
        for slab, used, written in zip(bundle.slabs, bundle.used, bundle.written):
            buf = self.pool.acquire(used, slab.dtype)
            loaded.append(self.copier.to_device(slab[:used], "act_load_bytes", out=buf, after=written))

    def release(self, key: Any) -> None:
        """After the key's backward: its device buffers back to the pool."""
        bundle = self._bundles.pop(key, None)
        if bundle is not None:
            self._slabs[key] = bundle.kept()
        for pending in self._loaded.pop(key, ()):
            self.pool.release(pending.tensor)

    def clear(self) -> None:
        """After a pass (or a failed step): nothing held on the device; host slabs stay for reuse."""
        for key in list(self._bundles):
            self.release(key)
        for key in list(self._loaded):
            self.release(key)

    def start_step(self) -> None:
        self.clear()
        self.nbytes.clear()

    @property
    def packed_bytes(self) -> int:
        """Bytes the last step packed to host memory (each also loaded back once)."""
        return sum(self.nbytes.values())

    @property
    def held_bytes(self) -> int:
        """Host memory the slabs hold between steps, for reuse."""
        return sum(slab.numel() * slab.element_size() for slabs in self._slabs.values()
                   for same in slabs.values() for slab in same)


class _Bundle:
    """One key's saved tensors of this step: host slabs, how much of each is used, the last copy into each
    (copies into host memory run in order, so the last one landing means they all have)."""

    def __init__(self, planned: dict[torch.dtype, int], spare: dict[tuple[torch.dtype, int], list[torch.Tensor]]):
        self.planned = planned          # numel per dtype the key packed last time
        self.packed: dict[torch.dtype, int] = {}
        self.spare = spare              # last step's slabs, by (dtype, numel)
        self.slabs: list[torch.Tensor] = []
        self.used: list[int] = []
        self.written: list[Pending | None] = []
        self.open: dict[torch.dtype, int] = {}      # the slab each dtype fills now

    def add(self, slab: torch.Tensor) -> int:
        self.slabs.append(slab)
        self.used.append(0)
        self.written.append(None)
        self.open[slab.dtype] = len(self.slabs) - 1
        return self.open[slab.dtype]

    def reuse(self, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        spare = self.spare.get((dtype, numel))
        return spare.pop() if spare else None

    def drop_spares(self, dtype: torch.dtype) -> None:
        for k in [k for k in self.spare if k[0] == dtype]:
            del self.spare[k]

    def kept(self) -> dict[tuple[torch.dtype, int], list[torch.Tensor]]:
        """The slabs to offer the key's next step."""
        out: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        for slab in self.slabs:
            out.setdefault((slab.dtype, slab.numel()), []).append(slab)
        return out


class _Tap(torch.autograd.Function):
    """Identity on the input; its backward hands the input's gradient to the KeptGraph."""

    @staticmethod
    def forward(ctx, x, anchor, graph):
        ctx.graph = graph
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.graph.grad_in = grad
        return None, None, None


class _Root(torch.autograd.Function):
    """A zero-size stand-in for the output: its backward returns the output gradient set at backward time."""

    @staticmethod
    def forward(ctx, y, graph):
        ctx.graph = graph
        return y.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        grad, ctx.graph.grad_out = ctx.graph.grad_out, None
        return grad, None


class KeptGraph:
    """One sub-batch's forward through one unit, waiting for the gradient of its output."""

    def __init__(self, anchor: torch.Tensor):
        self.anchor = anchor          # a grad-requiring leaf that makes the tap differentiable
        self.root: torch.Tensor | None = None
        self.grad_in: torch.Tensor | None = None
        self.grad_out: torch.Tensor | None = None

    def input(self, x: torch.Tensor, needs_grad: bool) -> torch.Tensor:
        return _Tap.apply(x, self.anchor, self) if needs_grad else x

    def output(self, y: torch.Tensor) -> None:
        self.root = _Root.apply(y, self) if y.requires_grad else None

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor | None:
        """Backpropagate grad_out through the kept graph; returns the input's gradient (if it needs one)."""
        if self.root is not None:
            self.grad_out = grad_out
            torch.autograd.backward(self.root, self.root.new_empty(0))
        self.root = None
        grad, self.grad_in = self.grad_in, None
        return grad
