"""Parameters sharded across torch.distributed ranks: each rank keeps 1/W of every unit in host memory.

Loading a unit copies this rank's shard to the device and all-gathers the full unit there, both
asynchronous (the all-gather is launched after the copy on the parameter stream, and the unit's activation
waits on its work handle), so the next unit's gather overlaps this one's compute; its
gradients, accumulated on the device over all sub-batches, are reduce-scattered once, and each rank
offloads and steps only its shard (with only its shard of the optimizer state). gloo on the CPU,
NCCL on CUDA: the same calls.

Each unit is flattened with its trainable parameters first, so the trainable part of any shard is a
prefix of it: the optimizer steps flat shard parameters, which for element-wise optimizers such as
AdamW or SGD is the same update as on the unflattened parameters.

Under `param_offload: disk` (sltune.runtime.disk.weightfiles) each rank's shard of each unit's dtype copy is a file of
that rank's engine folder (beside its optimizer_offload disk files), written at setup and rewritten when the unit
steps, as one rank's whole units are: `unit.host` is a placeholder of the shard's size. `prefetch` only starts the
read of the next unit's shard into the window; `activate` waits for it, copies it to the device and all-gathers
there. The gather is launched at the activation, not ahead of it: a collective must start at the same point of the
program on every rank, and the moment a read lands is not one (launched when it lands, one rank's gather could
cross another's reduce-scatter). So the disk read is hidden behind the compute and the all-gather is not. Host
memory holds the window's shards (a few units' worth), not every unit's shard. The gradient shards borrow a
GradWindow's buffers from their offload to their step (spilled to a file when the step is deferred), as one
rank's gradients do, sized by the shard's trainable prefix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
# Imported now, before any process group exists, never later: this module's functions take
# `group=group.WORLD` as a default argument, evaluated at import. Imported after init_process_group
# (torch._dynamo imports it, and transformers imports dynamo when it builds a model), those defaults keep
# the default gloo group alive past destroy_process_group, its worker threads still running; at exit
# their std::thread objects are destroyed joinable: "terminate called without an active exception", SIGABRT.
import torch.distributed.nn.functional  # noqa: F401
from torch import nn

from sltune.runtime.disk.direct_io import aligned_empty
from sltune.runtime.disk.state import DiskState, Stepped
from sltune.runtime.disk.gradwindow import GradWindow
from sltune.runtime.params import BufferPool, ParamStore, ParamUnit, WeightFill, copy_own_data
from sltune.runtime.regions import region
from sltune.runtime.transfer import Copier, Pending
from sltune.runtime.disk.weightfiles import WeightFiles, placeholder

# the tensor collectives the engine runs (sltune.machine times the same): torch 2.13 renamed them (*_single); older
# releases have only the old names
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ShardedParamStore(ParamStore):
    """The ParamStore interface over sharded units; the model's parameters hold no data between loads."""

    def __init__(self, units: list[ParamUnit], dtype: torch.dtype, copier: Copier, pool: BufferPool,
                 train: bool = True, master: bool = False, fill: WeightFill = None,
                 on_device_accumulate: bool = True, disk: DiskState | None = None,
                 weights: WeightFiles | None = None):
        """As ParamStore's; `weights` (param_offload disk): each unit's shard goes to this rank's file once filled,
        and with `disk` (training, but the canonical schedule) the gradient shards stream through a GradWindow."""
        streamed = self._attach(units, copier, pool, False, train, master, on_device_accumulate, disk, weights)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.shard_params: list[nn.Parameter] = []
        fill = fill or copy_own_data
        device = copier.device
        grad_dtype = torch.float32 if self.master else dtype
        for unit in units:
            if not unit.params:
                continue
            unit.params.sort(key=lambda p: not p.requires_grad)      # trainable first (a stable sort)
            unit.record_shapes()
            numel, trainable = unit.numel, unit.grad_numel
            shard = -(-numel // self.world)                           # ceil
            full = torch.zeros(shard * self.world, dtype=torch.float32 if self.master else dtype, device=device)
            off = 0
            unit.offsets, unit.grad_offsets = [], []
            for p in unit.params:
                fill(p, full[off:off + p.numel()].view(p.shape))
                unit.offsets.append(off)
                unit.grad_offsets.append(off if p.requires_grad else None)
                off += p.numel()
            dist.broadcast(full, src=0)                               # every rank starts from rank 0's weights
            lo = self.rank * shard
            unit.shard = shard
            unit.padded = shard * self.world
            unit.trainable_here = max(0, min(shard, trainable - lo))
            if weights is not None:     # filled here, then written to this rank's file and freed
                raw = aligned_empty(shard * dtype.itemsize)
                unit.host = raw[:shard * dtype.itemsize].view(dtype)
            else:
                unit.host = copier.host_empty(shard, dtype)
            unit.host.copy_(full[lo:lo + shard].cpu())
            if self.master:
                unit.master = full[lo:lo + shard].cpu().clone()
            del full
            if weights is not None:
                weights.add(unit, raw, shard * dtype.itemsize)
                unit.host = placeholder((shard,), dtype)
                del raw
            unit.has_grads = trainable > 0
            if unit.has_grads and train:
                # a shard parameter on every rank, empty where the trainable prefix ends before this shard:
                # every rank then builds the same optimizer, whatever its share
                shape = torch.Size([unit.trainable_here])
                unit.host_grad = None if streamed else \
                    copier.host_empty(unit.trainable_here, grad_dtype).zero_()
                grad = placeholder(shape, grad_dtype) if streamed else unit.host_grad
                if self.master_on_disk:         # bound to the slot's master when the unit steps
                    param = nn.Parameter(placeholder(shape, torch.float32))
                elif weights is not None:       # bound to the staged copy's view when the unit steps
                    param = nn.Parameter(placeholder(shape, dtype))
                else:
                    param = nn.Parameter(unit.stepped[:unit.trainable_here])
                    param.grad = unit.host_grad
                unit.shard_param = param
                self.shard_params.append(param)
                self.stepped[id(unit)] = [Stepped(unit, 0, unit.trainable_here, shape, grad, param)]
            else:
                unit.host_grad = None
                unit.shard_param = None
            if self.disk is not None:
                mine = self.stepped.get(id(unit), [])
                frozen = [(mine[0].numel if mine else 0, shard - (mine[0].numel if mine else 0))]
                self.disk.add_unit(unit, mine, unit.master, frozen)
                unit.master = None
            self._empty(unit)
        if streamed:
            self.grads = GradWindow([u for u in units if id(u) in self.stepped], grad_dtype, self.disk.files,
                                    self.disk.folder, self.disk.counters, self.disk.lock, self.bind_grads,
                                    numel=lambda u: u.trainable_here)

    @staticmethod
    def _empty(unit: ParamUnit) -> None:
        """Between loads the model's parameters hold nothing: the data lives in the shards."""
        for p in unit.params:
            p.grad = None
            p.data = torch.empty(0, dtype=p.dtype)

    # -- loading -----------------------------------------------------------------------------------
    loads_in_parts = False      # a unit is gathered whole

    def prefetch(self, unit: ParamUnit | None) -> None:
        if unit is None or unit.host is None or unit.dev is not None or unit.pending:
            return
        if self.weights is not None:    # its shard read ahead; the copy and the gather wait for the activation
            self.weights.request(unit)
            return
        unit.pending = self._gather(unit, unit.host)

    def activate(self, unit: ParamUnit) -> None:
        if self.weights is None or unit.host is None or unit.dev is not None:
            super().activate(unit)
            return
        with region("disk", "weights_read"):    # what the read ahead did not hide
            src = self.weights.values(unit)
        pending = self._gather(unit, src)
        self.weights.done(unit)                 # the copy out of the window buffer has landed (_gather)
        unit.dev = pending.wait()
        self._point(unit, unit.dev, None)

    def _gather(self, unit: ParamUnit, src: torch.Tensor) -> Pending:
        """Copy this rank's shard `src` into its place of a device buffer of the whole unit and launch the
        all-gather of the rest; the result's wait() waits on it."""
        full = self.pool.acquire(unit.padded, unit.host.dtype)
        mine = full[self.rank * unit.shard:(self.rank + 1) * unit.shard]
        copied = self.copier.to_device(src, "param_load_bytes", out=mine)
        self.copier.counters.allgather_bytes += full.numel() * full.element_size()
        with region("all_gather", unit.name):   # asynchronous: activate() waits on the work handle
            pending = self.copier.gather_after(copied, lambda shard: all_gather(full, shard, async_op=True), full)
        if self.weights is not None and copied.event is not None:   # src is a window buffer, reused after
            copied.event.synchronize()
        return pending

    def _home(self, unit: ParamUnit) -> None:
        self._empty(unit)

    # -- gradients ---------------------------------------------------------------------------------
    def begin_grads(self, unit: ParamUnit) -> None:
        """Gradients of the whole unit (every rank's share), to be reduce-scattered."""
        if unit.host is not None and unit.has_grads:
            self._device_grads(unit, unit.padded)

    def offload_grads(self, unit: ParamUnit, accumulate: bool) -> Pending | None:
        """Sum the unit's gradients over ranks into this rank's shard, then offload that shard (into a buffer a
        GradWindow lends, under param_offload disk)."""
        src = self._device_sum(unit)
        if src is None:
            return None
        mine = torch.empty(unit.shard, dtype=src.dtype, device=src.device)
        self.copier.counters.reduce_scatter_bytes += src.numel() * src.element_size()
        with region("reduce_scatter", unit.name):
            reduce_scatter(mine, src)
        if self.grads is not None and id(unit) in self.stepped:
            with self.pool.memory.paused():     # host memory, not the device's
                out = self.grads.acquire(unit)  # even an empty share: the stepping takes it back
            return self.copier.to_host(mine[:unit.trainable_here], out, "grad_offload_bytes")
        if not unit.trainable_here:
            return None
        return self.copier.to_host(mine[:unit.trainable_here], unit.host_grad, "grad_offload_bytes",
                                   accumulate=accumulate)

    def host_grad_numel(self, unit: ParamUnit) -> int:
        return unit.trainable_here if self.trains(unit) else 0

    def bind_grads(self, unit: ParamUnit, flat: torch.Tensor | None) -> None:
        """Point the optimizer's view of the unit's gradient shard (its slices' in the disk tier's blocks too) at
        `flat`, the buffer a GradWindow lent it; None: at nothing (the step is over, the buffer goes)."""
        for s in self._grad_items(unit):
            if flat is None:
                s.grad = None
            else:
                s.grad = flat if s.part is None else flat[s.part:s.part + s.numel]

    # -- results -----------------------------------------------------------------------------------
    def full_state(self) -> dict[int, torch.Tensor]:
        """Every parameter (its float32 master under mixed precision), gathered from all shards onto the host
        of every rank (keyed by id)."""
        out: dict[int, torch.Tensor] = {}
        for unit in self.units:
            if unit.host is None:
                continue
            values = self.master_values(unit)
            mine = (values if values is not None else self.weight_values(unit)).to(self.copier.device)
            full = torch.empty(unit.padded, dtype=mine.dtype, device=mine.device)
            all_gather(full, mine)
            full = full.cpu()
            for p, view in zip(unit.params, unit.views(full, unit.offsets)):
                out[id(p)] = view
        return out
