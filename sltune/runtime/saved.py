"""A unit's forward kept for its backward: autograd's saved tensors held aside, so nothing is recomputed.

`activations: offload` runs each group's forward with autograd once per sub-batch and keeps the graph until
that group's backward, phases later. Two things would otherwise pin device memory for every sub-batch:

- the tensors autograd saves (torch.autograd.graph.saved_tensors_hooks): packed into host memory, one
  buffer per saved tensor reused from step to step, and loaded back for the sub-batch about to run its
  backward (one sub-batch ahead). Parameters are not saved at all: a saved tensor that lives in a live
  unit's device buffer is packed as (unit, offset, shape, stride) and re-bound to the unit's buffer of
  the backward phase, which holds the same values (the optimizer steps only after the whole pass);
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
from sltune.runtime.params import ParamUnit
from sltune.runtime.transfer import Copier, Pending


@dataclass(frozen=True)
class _ParamRef:
    unit: ParamUnit
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


class SavedTensors:
    """Autograd's saved tensors per (unit, sub-batch) key, in host memory or left on the device."""

    def __init__(self, copier: Copier, memory: DeviceMemory, host: bool):
        self.copier = copier
        self.memory = memory
        self.host = host
        self._bundles: dict[Any, list[tuple[torch.Tensor, Pending]]] = {}
        self._loaded: dict[Any, list[Pending]] = {}
        self._buffers: dict[Any, list[torch.Tensor]] = {}    # host buffers by key, reused across steps
        self.nbytes: dict[Any, int] = {}                      # bytes packed to host per key, this step

    @contextlib.contextmanager
    def keeping(self, key: Any, units: tuple[ParamUnit, ...]) -> Iterator[None]:
        """Run a forward whose saved tensors are held under `key` until `release(key)`."""
        live = {u.dev.untyped_storage().data_ptr(): u for u in units if u.dev is not None}
        bundle: list[tuple[torch.Tensor, Pending]] = []
        self._bundles[key] = bundle
        self.nbytes[key] = 0
        seen: dict[tuple, tuple[torch.Tensor, tuple]] = {}   # one copy of a tensor saved by several ops

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
            idx = len(bundle)
            buf = self._buffer(key, idx, t)
            bundle.append((buf, self.copier.to_host(t, buf, "act_offload_bytes")))
            self.nbytes[key] += buf.numel() * buf.element_size()
            handle = (key, idx)
            seen[sig] = (t, handle)         # holding t keeps its storage from being reused under the same key
            return handle

        def unpack(packed):
            if isinstance(packed, _ParamRef):
                return packed.unit.dev.as_strided(packed.shape, packed.stride,
                                                  packed.unit.dev.storage_offset() + packed.offset)
            if isinstance(packed, torch.Tensor):
                return packed
            key_, idx = packed
            if key_ not in self._loaded:
                self.prefetch(key_)
            return self._loaded[key_][idx].wait()

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            seen.clear()

    def _buffer(self, key: Any, idx: int, t: torch.Tensor) -> torch.Tensor:
        bufs = self._buffers.setdefault(key, [])
        if idx < len(bufs) and bufs[idx].shape == t.shape and bufs[idx].dtype == t.dtype:
            return bufs[idx]
        with self.memory.paused():
            buf = self.copier.host_empty(t.shape, t.dtype)
        if idx < len(bufs):
            bufs[idx] = buf
        else:
            bufs.append(buf)
        return buf

    def prefetch(self, key: Any) -> None:
        """Start loading a key's saved tensors back to the device (before its backward needs them)."""
        if key in self._loaded or key not in self._bundles:
            return
        self._loaded[key] = [self.copier.to_device(buf, "act_load_bytes", after=written)
                             for buf, written in self._bundles[key]]

    def release(self, key: Any) -> None:
        self._bundles.pop(key, None)
        self._loaded.pop(key, None)

    def clear(self) -> None:
        """After a pass (or a failed step): nothing held on the device; host buffers stay for reuse."""
        self._bundles.clear()
        self._loaded.clear()

    def start_step(self) -> None:
        self.clear()
        self.nbytes.clear()

    @property
    def packed_bytes(self) -> int:
        """Bytes the last step packed to host memory (each also loaded back once)."""
        return sum(self.nbytes.values())


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
