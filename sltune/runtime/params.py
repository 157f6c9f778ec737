"""Parameters in flat host buffers, one per unit (the embedding, each group of live blocks, the head),
loaded to the device when a unit is needed and released after.

The model keeps its own nn.Parameter objects: their .data points into the host buffer between steps and
into a device buffer while their unit is live, so the user's model computes as written and always holds
the current weights. Gradients accumulate on the device across sub-batches, in a flat buffer per unit,
and are offloaded once. In the resident schedule the "host" buffers live on the device and nothing moves;
its gradients are autograd's own, dropped before each step as zero_grad(set_to_none=True) does, so the first
sub-batch writes them rather than adding to zeros.

Mixed precision (a training engine with dtype bfloat16/float16 and mixed_precision), as ZeRO-Offload keeps it:
each unit also has a float32 master on the host, which the optimizer steps, and float32 host gradients. The
dtype copy the device loads is refreshed from the master after every step, so parameter traffic stays in dtype
bytes. Autograd computes each sub-batch's gradients in dtype; they are added into a float32 accumulator on the
device after every sub-batch (`flush_grads`), which is offloaded once: the sum over sub-batches is a float32 sum
of dtype gradients, as in plain PyTorch with a float32 master and a dtype copy per micro-batch. The canonical
schedule offloads each micro-batch's dtype gradients and adds them on the host in float32; resident keeps the
master, the accumulators and the optimizer on the device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from sltune.runtime.disk.direct_io import aligned_empty
from sltune.runtime.disk.state import DiskState, Stepped
from sltune.runtime.disk.gradwindow import GradWindow
from sltune.runtime.memory import DeviceMemory
from sltune.runtime.regions import region
from sltune.runtime.rowgrads import add_rows
from sltune.runtime.streams import Event, Streams
from sltune.runtime.transfer import Copier, Pending
from sltune.runtime.disk.weightfiles import WeightFiles, placeholder


@dataclass
class ParamUnit:
    """Parameters that are loaded and released together, flattened into one buffer."""

    name: str
    params: list[nn.Parameter]
    host: torch.Tensor | None = None            # flat parameters in dtype (pinned on CUDA): what the device loads
    master: torch.Tensor | None = None          # mixed precision: the float32 master of `host`, which is stepped
    host_grad: torch.Tensor | None = None       # flat gradients of the trainable ones (float32 under a master)
    offsets: list[int] = field(default_factory=list)
    grad_offsets: list[int | None] = field(default_factory=list)
    dev: torch.Tensor | None = None             # the live device copy
    dev_grad: torch.Tensor | None = None
    dev_grad32: torch.Tensor | None = None      # mixed precision: this step's float32 sum of dev_grad
    pending: Pending | None = None
    shapes: list[torch.Size] = field(default_factory=list)   # recorded: sharded parameters are emptied
    parts: list[int] = field(default_factory=list)    # a group's layer boundaries in the flat buffer: [0, .., numel]
    # sharded units (sltune.runtime.sharding): this rank's slice of the flat buffer
    shard: int = 0
    padded: int = 0
    trainable_here: int = 0
    has_grads: bool = False
    shard_param: nn.Parameter | None = None

    def __post_init__(self) -> None:
        self.record_shapes()

    def record_shapes(self) -> None:
        self.shapes = [p.shape for p in self.params]

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def grad_numel(self) -> int:
        return sum(s.numel() for s, p in zip(self.shapes, self.params) if p.requires_grad)

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size() if self.host is not None else 0

    @property
    def grad_nbytes(self) -> int:
        return self.host_grad.numel() * self.host_grad.element_size() if self.host_grad is not None else 0

    @property
    def stepped(self) -> torch.Tensor | None:
        """The flat values the optimizer steps: the master, else the dtype copy itself."""
        return self.master if self.master is not None else self.host

    def views(self, flat: torch.Tensor, offsets) -> list[torch.Tensor | None]:
        return [None if off is None else flat[off:off + shape.numel()].view(shape)
                for shape, off in zip(self.shapes, offsets)]


WeightFill = Callable[[nn.Parameter, torch.Tensor], None] | None


def copy_own_data(p: nn.Parameter, dst: torch.Tensor) -> None:
    dst.copy_(p.data)


class BufferPool:
    """Reuses device buffers by size. On the CPU a fresh large buffer costs page faults on every load,
    so released buffers are kept; on CUDA the caching allocator already does this."""

    def __init__(self, device: torch.device, memory: DeviceMemory, streams: Streams | None = None):
        self.device = device
        self.memory = memory
        self.streams = streams
        self.cache = device.type != "cuda"
        # each free buffer with the events its reuse waits for (a side stream may still be using it)
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, list[Event]]]] = {}

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((numel, dtype))
        if free:
            buf, fence = free.pop()
            for event in fence:
                event.synchronize()
        else:
            with self.memory.paused():
                buf = torch.empty(numel, dtype=dtype, device=self.device)
        try:
            self.memory.alloc(buf.numel() * buf.element_size())    # may raise DeviceMemoryExceeded
        except BaseException:
            if self.cache:
                self._free.setdefault((numel, dtype), []).append((buf, []))
            raise
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.memory.free(buf.numel() * buf.element_size())
        if self.cache:
            fence = self.streams.release_fence(buf) if self.streams is not None else []
            self._free.setdefault((buf.numel(), buf.dtype), []).append((buf, fence))

    def clear(self) -> None:
        self._free.clear()

    @property
    def held_bytes(self) -> int:
        """Released buffers kept for reuse: device memory the pool holds beyond what is live (on the CPU, part
        of the process's resident memory)."""
        return sum(buf.numel() * buf.element_size() for free in self._free.values() for buf, _ in free)


class ParamStore:
    """Moves units between host and device and keeps every Parameter pointing at the right copy."""

    _kept: frozenset[int] | set[int] = frozenset()     # ids of units that stay on the device once loaded
    _complete: frozenset[int] | set[int] = frozenset() # ... whose device buffer holds all their weights
    weights: WeightFiles | None = None                  # param_offload disk: the dtype copies' files
    grads: GradWindow | None = None                     # ... and the gradients' bounded window

    def __init__(self, units: list[ParamUnit], dtype: torch.dtype, copier: Copier, pool: BufferPool,
                 resident: bool, train: bool = True, master: bool = False, fill: WeightFill = None,
                 on_device_accumulate: bool = True, disk: "DiskState | None" = None,
                 weights: WeightFiles | None = None):
        """`train`: allocate gradients (an engine that only generates needs none). `master`: float32 master
        weights and gradients beside the dtype copy. `fill(p, dst)` writes a parameter's initial values into its
        view of the buffer (a checkpoint's tensor cast as it is copied, a seeded init); default its own data.
        `on_device_accumulate`: under a master, sum the sub-batches' gradients on the device in float32 (the
        canonical schedule offloads every micro-batch's instead). `disk` (optimizer_offload: disk): the masters go
        to its files, unit by unit as they are filled, and the optimizer's Parameters are placeholders it binds when
        a unit steps.
        `weights` (param_offload: disk): each unit's dtype copy goes to its file once filled; `unit.host` is then a
        placeholder (its numel and dtype, no memory) and every load reads the file through the window; in training
        (but the canonical schedule, which sums every micro-batch's gradients on the host) the gradients are not
        held whole either: a unit's borrow a GradWindow's buffer from their offload to their step."""
        streamed = self._attach(units, copier, pool, resident, train, master, on_device_accumulate, disk, weights)
        grad_dtype = torch.float32 if self.master else dtype
        fill = fill or copy_own_data
        device = copier.device

        def alloc(numel: int, dt: torch.dtype) -> torch.Tensor:
            return torch.empty(numel, dtype=dt, device=device) if resident else copier.host_empty(numel, dt)

        for unit in units:
            if not unit.params:
                continue
            if weights is not None:     # filled here, then written to its file and freed
                raw = aligned_empty(unit.numel * dtype.itemsize)
                unit.host = raw[:unit.numel * dtype.itemsize].view(dtype)
            else:
                unit.host = alloc(unit.numel, dtype)
            unit.offsets, unit.grad_offsets = [], []
            off = goff = 0
            for p in unit.params:
                unit.offsets.append(off)
                off += p.numel()
                if p.requires_grad:
                    unit.grad_offsets.append(goff)
                    goff += p.numel()
                else:
                    unit.grad_offsets.append(None)
            if self.master:     # on its way to disk: filled here, then written out and freed (not pinned)
                unit.master = (torch.empty(unit.numel, dtype=torch.float32) if self.master_on_disk
                               else alloc(unit.numel, torch.float32))
            for p, view in zip(unit.params, unit.views(unit.stepped, unit.offsets)):
                fill(p, view)
            if unit.master is not None:
                unit.host.copy_(unit.master)
            if weights is not None:
                weights.add(unit, raw, unit.numel * dtype.itemsize)
                unit.host = placeholder((unit.numel,), dtype)
                del raw
            unit.has_grads = goff > 0
            if goff and train and (self.master or not resident) and not streamed:
                unit.host_grad = alloc(goff, grad_dtype).zero_()
            self._point(unit, unit.host, unit.host_grad)
            if unit.host_grad is not None or (goff and streamed):
                self.stepped[id(unit)] = self._stepped_of(unit, grad_dtype)
            if self.disk is not None:
                frozen = [(off, shape.numel()) for off, g, shape in zip(unit.offsets, unit.grad_offsets, unit.shapes)
                          if g is None]
                self.disk.add_unit(unit, self.stepped.get(id(unit), []), unit.master, frozen)
                unit.master = None
            if resident and unit.master is not None and unit.host_grad is not None:
                # each sub-batch's dtype gradients, flushed into the float32 host_grad (on the device here)
                unit.dev_grad = torch.zeros(goff, dtype=dtype, device=device)
                for p, g in zip(unit.params, unit.views(unit.dev_grad, unit.grad_offsets)):
                    p.grad = g
        if resident:
            for unit in units:
                extra = [unit.master, unit.dev_grad]
                pool.memory.alloc(unit.nbytes + unit.grad_nbytes + sum(t.numel() * t.element_size()
                                                                       for t in extra if t is not None))
        if streamed:
            self.grads = GradWindow([u for u in units if id(u) in self.stepped], grad_dtype, self.disk.files,
                                    self.disk.folder, self.disk.counters, self.disk.lock, self.bind_grads)

    def _attach(self, units: list[ParamUnit], copier: Copier, pool: BufferPool, resident: bool, train: bool,
                master: bool, on_device_accumulate: bool, disk: "DiskState | None",
                weights: WeightFiles | None) -> bool:
        """What every store keeps (this one and sltune.runtime.sharding's); whether the gradients stream through a
        GradWindow."""
        self.units = units
        self.copier = copier
        self.pool = pool
        self.resident = resident
        self.master = master and train
        self.accumulate32 = self.master and on_device_accumulate and not resident
        self._unsummed: set[int] = set()    # units whose float32 sum no flush has written yet (holds no zeros)
        self.disk = disk if train else None
        self.master_on_disk = self.master and self.disk is not None
        self.weights = weights
        self.stepped: dict[int, list[Stepped]] = {}      # per unit (by id): the tensors the optimizer steps
        self._masters: dict[int, nn.Parameter] = {}     # model parameter id -> its master's Parameter
        return weights is not None and self.disk is not None and on_device_accumulate and not resident

    def _stepped_of(self, unit: ParamUnit, grad_dtype: torch.dtype) -> list[Stepped]:
        """The unit's trainable tensors as the optimizer steps them: under a master a float32 Parameter viewing
        it with its float32 gradient (a placeholder when the master is on disk), else the model's own. Gradients
        in a GradWindow are placeholders until their unit borrows a buffer (bind_grads)."""
        out = []
        grads = unit.views(unit.host_grad, unit.grad_offsets) if unit.host_grad is not None else \
            [None if off is None else placeholder(shape, grad_dtype)
             for off, shape in zip(unit.grad_offsets, unit.shapes)]
        masters = unit.views(unit.master, unit.offsets) if self.master else [None] * len(unit.params)
        for p, off, shape, g, master in zip(unit.params, unit.offsets, unit.shapes, grads, masters):
            if g is None:
                continue
            if self.master_on_disk:
                param = nn.Parameter(torch.zeros((), dtype=torch.float32).expand(shape))
            elif self.master:
                param = nn.Parameter(master)
                param.grad = g
            else:
                param = p
            if self.master:
                self._masters[id(p)] = param
            out.append(Stepped(unit, off, shape.numel(), shape, g, param))
        return out

    @staticmethod
    def _point(unit: ParamUnit, flat: torch.Tensor, grad_flat: torch.Tensor | None) -> None:
        """Parameters onto `flat`, their .grad onto `grad_flat` (None where it is a float32 master's); a placeholder
        `flat` (the weights on disk) gives each a placeholder of its own."""
        if grad_flat is not None and grad_flat.dtype != flat.dtype:
            grad_flat = None
        grads = unit.views(grad_flat, unit.grad_offsets) if grad_flat is not None else [None] * len(unit.params)
        views = [placeholder(shape, flat.dtype) for shape in unit.shapes] if flat.numel() and not flat.stride(0) \
            else unit.views(flat, unit.offsets)
        for p, view, g in zip(unit.params, views, grads):
            p.grad = None
            p.data = view
            p.grad = g

    # -- loading ---------------------------------------------------------------------------------
    def prefetch(self, unit: ParamUnit | None) -> None:
        """Start copying a unit's parameters to the device (a side stream on CUDA)."""
        if unit is None or self.resident or unit.host is None or unit.dev is not None or unit.pending:
            return
        if self.weights is not None:    # its file read ahead; the device copy waits for the activation
            self.weights.request(unit)
            return
        buf = self.pool.acquire(unit.host.numel(), unit.host.dtype)
        unit.pending = self.copier.to_device(unit.host, "param_load_bytes", out=buf)

    def read_ahead(self, unit: ParamUnit | None) -> None:
        """Start reading a unit's weights file (param_offload disk) without copying anything to the device yet:
        where a device copy ahead would only push the live unit out of the cache (generation on the CPU)."""
        if self.weights is not None:
            self.prefetch(unit)

    def activate(self, unit: ParamUnit) -> None:
        """Make the unit's parameters live on the device."""
        if self.resident or unit.host is None or unit.dev is not None:
            return
        if self.weights is not None:
            with region("disk", "weights_read"):    # what the read ahead did not hide: the breakdown's disk slice
                src = self.weights.values(unit)
            buf = self.pool.acquire(unit.host.numel(), unit.host.dtype)
            copied = self.copier.to_device(src, "param_load_bytes", out=buf)
            if copied.event is not None:    # the window buffer is reused once the copy has read it
                copied.event.synchronize()
            unit.dev = copied.wait()
            self.weights.done(unit)
            self._point(unit, unit.dev, None)
            return
        self.prefetch(unit)
        unit.dev = unit.pending.wait()
        unit.pending = None
        self._point(unit, unit.dev, None)

    @property
    def loads_in_parts(self) -> bool:
        """Whether load_part may copy a unit piecewise: copies are synchronous and the shards are not split."""
        return not self.resident and self.copier.streams is None

    def load_part(self, unit: ParamUnit, part: int) -> None:
        """Copy one layer of a group into its device buffer, which the first part reserves (the parameters
        then point into it). A decode step on synchronous copies (the CPU) loads a group of k layers one
        layer at a time, just before all N sub-batches read that layer: the copy is still in the cache,
        where k layers copied at once push each other out of it (k=2 lost 8% to k=1 at b=4 N=4)."""
        if unit.host is None or id(unit) in self._complete:
            return
        if unit.dev is None:
            unit.dev = self.pool.acquire(unit.host.numel(), unit.host.dtype)
            self._point(unit, unit.dev, None)
        start, end = unit.parts[part], unit.parts[part + 1]
        if self.weights is not None:
            with region("disk", "weights_read"):
                src = self.weights.values(unit)
        else:
            src = unit.host
        self.copier.to_device(src[start:end], "param_load_bytes", out=unit.dev[start:end])
        if self.weights is not None and part == len(unit.parts) - 2:
            self.weights.done(unit)

    def release(self, unit: ParamUnit) -> None:
        """Point the parameters back at their home between loads and free the device buffers; a kept unit
        stays live (its buffer holds all its weights by now) until keeping() ends."""
        if self.resident or unit.host is None:
            return
        if id(unit) in self._kept:
            if unit.dev is not None:
                self._complete.add(id(unit))
            return
        self._home(unit)
        self._unsummed.discard(id(unit))
        for attr in ("dev", "dev_grad", "dev_grad32"):
            buf = getattr(unit, attr)
            if buf is not None:
                self.pool.release(buf)
                setattr(unit, attr, None)
        if unit.pending is not None:     # a prefetch never used: its copy or gather must end before reuse
            self.pool.release(unit.pending.wait())
            unit.pending = None
        if self.weights is not None:     # a read-ahead never used (a failed step), or a part-loaded group's
            self.weights.done(unit)

    @contextlib.contextmanager
    def keeping(self, units: Sequence[ParamUnit]) -> Iterator[None]:
        """Within the block these units stay on the device once loaded: copied in once, not at every use.
        Generation keeps a share of the weights this way for a whole call (weights_on_device, FlexGen's
        weight placement); nothing changes the weights meanwhile, so the device copy stays current."""
        self._kept, self._complete = {id(u) for u in units if u.host is not None}, set()
        try:
            yield
        finally:
            self._kept, self._complete = frozenset(), frozenset()
            for unit in units:
                self.release(unit)

    def _home(self, unit: ParamUnit) -> None:
        """Where the parameters point between loads: the host copy and its gradients (none in a GradWindow: a
        buffer is the unit's only until it steps)."""
        self._point(unit, unit.host, unit.host_grad)

    def trains(self, unit: ParamUnit) -> bool:
        """Whether the unit's gradients go to the host and step: in a buffer of its own or one a GradWindow lends."""
        return unit.host_grad is not None or id(unit) in self.stepped and self.grads is not None

    def host_grad_numel(self, unit: ParamUnit) -> int:
        """How many gradient values of the unit this process offloads (a rank's shard when sharded)."""
        if unit.host_grad is not None:
            return unit.host_grad.numel()
        return unit.grad_numel if self.trains(unit) else 0

    def bind_grads(self, unit: ParamUnit, flat: torch.Tensor | None) -> None:
        """Point the optimizer's view of the unit's gradients (Stepped.grad, a slice's in the disk tier's blocks too)
        at `flat`, the buffer a GradWindow lent it; None: at nothing (the step is over, the buffer goes)."""
        items = self._grad_items(unit)
        if flat is None:
            for s in items:
                s.grad = None
            return
        views = dict(zip(unit.offsets, unit.views(flat, unit.grad_offsets)))
        for s in items:
            if s.part is None:
                s.grad = views[s.offset]
            else:
                s.grad = views[s.offset - s.part].reshape(-1)[s.part:s.part + s.numel]

    def _grad_items(self, unit: ParamUnit) -> list[Stepped]:
        """What views the unit's gradients for the optimizer: its stepped tensors and, in the disk tier's blocks,
        their slices (each once)."""
        items = {id(s): s for s in self.stepped.get(id(unit), [])}
        if self.disk is not None:
            items.update((id(s), s) for block in self.disk.blocks_of(unit) for s in block.items)
        return list(items.values())

    # -- gradients -------------------------------------------------------------------------------
    def begin_grads(self, unit: ParamUnit) -> None:
        """Give the live parameters their device gradients: under a master a float32 sum each sub-batch's go into
        (flush_grads), else a zeroed dtype buffer autograd accumulates into."""
        if not self.trains(unit) or self.resident:
            return  # resident: autograd's own gradients, on the device (flat in dtype under a master)
        self._device_grads(unit, unit.grad_numel)

    def _device_grads(self, unit: ParamUnit, numel: int) -> None:
        if self.accumulate32:       # autograd's own gradients, summed and dropped by flush_grads
            unit.dev_grad32 = self.pool.acquire(numel, torch.float32)
            self._unsummed.add(id(unit))
            for p in unit.params:
                p.grad = None
            return
        unit.dev_grad = self.pool.acquire(numel, unit.host.dtype).zero_()
        for p, g in zip(unit.params, unit.views(unit.dev_grad, unit.grad_offsets)):
            p.grad = g

    def flush_grads(self, units: Sequence[ParamUnit]) -> None:
        """After a sub-batch's backward under a master: add its dtype gradients into the float32 sum.

        On the device (not resident) the dtype gradients are autograd's own, each taken as the backward made it
        (no buffer of zeros filled and added to first) and dropped here; the first sub-batch's are copied into the
        sum rather than added to zeros. The same values, and about 8 bytes of memory traffic less per parameter and
        sub-batch: measured on qwen2-0.5b (bf16, both on disk, b=1 N=4 seq 32, activations offload, three rounds
        interleaved) a step took 14.0 [12.5, 15.2] s against 16.0 [15.8, 17.1] s, the same loss to the bit."""
        if not self.master:
            return
        for unit in units:
            if self.resident:
                if unit.host_grad is not None and unit.dev_grad is not None:
                    with region("compute", "grad_sum"):
                        unit.host_grad.add_(unit.dev_grad)
                        unit.dev_grad.zero_()
                continue
            acc = unit.dev_grad32
            if acc is None:
                continue
            with region("compute", "grad_sum"):
                first = id(unit) in self._unsummed
                self._unsummed.discard(id(unit))
                if first and acc.numel() > unit.grad_numel:     # a shard's padding: summed over ranks as zeros
                    acc[unit.grad_numel:].zero_()
                for p, view in zip(unit.params, unit.views(acc, unit.grad_offsets)):
                    if view is None:
                        continue
                    g, p.grad = p.grad, None
                    if g is None:           # no gradient reached it this sub-batch
                        if first:
                            view.zero_()
                    elif g.is_sparse:       # the input embedding's touched rows (sltune.runtime.rowgrads)
                        if first:
                            view.zero_()
                        add_rows(view, g)
                    elif first:
                        view.copy_(g)
                    else:
                        view.add_(g)

    def offload_grads(self, unit: ParamUnit, accumulate: bool) -> Pending | None:
        """Copy (or, for later micro-batches, add) the unit's device gradients into its host gradients; returns
        the copy (its event, when asynchronous, says when the host may read them)."""
        if self.resident:
            return None
        src = self._device_sum(unit)
        if src is None:
            return None
        if self.grads is not None:      # a buffer, for as long as the unit takes to step (or to spill)
            with self.pool.memory.paused():     # host memory, not the device's
                out = self.grads.acquire(unit)
            return self.copier.to_host(src, out, "grad_offload_bytes")
        return self.copier.to_host(src, unit.host_grad, "grad_offload_bytes", accumulate=accumulate)

    def _device_sum(self, unit: ParamUnit) -> torch.Tensor | None:
        """The device buffer holding the unit's gradients summed over this step's sub-batches (the float32 sum under
        a master, flushed first if no flush wrote it yet), or None where it has none."""
        if id(unit) in self._unsummed:      # never flushed: its sum is the gradients autograd holds
            self.flush_grads((unit,))
        return unit.dev_grad32 if unit.dev_grad32 is not None else unit.dev_grad

    def drop_resident_grads(self) -> None:
        if self.resident:
            for unit in self.units:
                if self.master and unit.host_grad is not None:
                    unit.host_grad.zero_()
                    continue
                for p in unit.params:
                    p.grad = None

    # -- the optimizer's side ------------------------------------------------------------------------
    def master_params(self) -> dict[int, nn.Parameter]:
        """Under a master: a float32 Parameter per trainable model parameter (keyed by the model parameter's
        id), viewing the master with its float32 gradient (a placeholder when the master is on disk), for the
        optimizer to step."""
        return self._masters

    def master_values(self, unit: ParamUnit) -> torch.Tensor | None:
        """The unit's flat float32 master (a rank's shard of it when sharded): in memory, or read from the disk's
        committed version. None without a master."""
        if self.master_on_disk:
            return self.disk.master_of(unit, unit.host.numel())
        return unit.master

    def weight_values(self, unit: ParamUnit) -> torch.Tensor | None:
        """The unit's flat dtype copy as it is between steps: read from its file under param_offload disk, else
        the host buffer itself."""
        if unit.host is None:
            return None
        return self.weights.read(unit) if self.weights is not None else unit.host

    def grad_buffers(self) -> list[torch.Tensor]:
        """The flat gradients the optimizer reads, once each: what clipping and loss scaling act on."""
        return [u.host_grad for u in self.units if u.host_grad is not None and u.host_grad.numel()]

    def refresh(self) -> None:
        """After an optimizer step under a master: the dtype copy the device loads, from the stepped master."""
        for unit in self.units:
            if unit.master is not None and unit.has_grads:
                unit.host.copy_(unit.master)

    def reset(self) -> None:
        """After a failed step: everything back on the host copy, no device buffers held."""
        for unit in self.units:
            self.release(unit)
