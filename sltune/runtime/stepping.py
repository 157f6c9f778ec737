"""The optimizer stepping one unit at a time, as the backward makes each unit's gradients final.

A unit's gradients are final once the last micro-batch's backward through it has offloaded them (speedloader:
its one backward; canonical: the N-th micro-batch's). Its optimizer step needs nothing more, unless the step
needs every gradient first: clipping on the global norm, or float16's overflow check. So a step is either
    early     (no clipping, no loss scaling): a unit steps on the stepping thread as soon as its gradients are
              final, while the backward goes on below it; the gradient norm, when asked for, is computed after
    deferred  the norm, clipping and overflow check after the backward, then the units in the same order, one
              at a time (under disk still streamed through the window, read ahead during the backward)
Each tensor gets the update a whole-model step gives it: the optimizer steps with only the unit's tensors in its
groups, and element-wise optimizers (AdamW, SGD) compute each tensor alone, so the result is the same to the bit.

Under `optimizer_offload: disk` (sltune.runtime.disk.state) a unit steps block by block: the stepped tensors'
values (the float32 masters) and the optimizer's state tensors are bound to views of the block's slot, the
optimizer steps, its state is taken back out (between steps the optimizer holds only per-tensor counters), the
dtype copy the device loads is refreshed from the new master, and the slot is written behind. A failed step
(an exception in the backward or the stepping) rolls back: the committed version is still on disk, the dtype
copies of the units stepped so far are restored from it, and the optimizer's counters from a snapshot. Without a
master on disk the stepped values are the dtype copy itself, in host memory, which cannot be restored: those
steps are deferred to after the backward, and only an I/O error while stepping can leave them part-done. Under
disk_versions 1 a step that fails once a block's old file was dropped has no committed version to restore from:
the disk tier is torn (sltune.runtime.disk.state) and the engine refuses to go on.

Under `param_offload: disk` (sltune.runtime.disk.weightfiles) the dtype copy is not in host memory either: a unit steps
into a window buffer of its own (holding its committed copy first when the step updates it in place, without a
master, or keeps frozen values), which is written behind as the unit's next version and becomes the one loaded
when the step commits; a failed step deletes it, so the committed copy needs no rollback. Its gradients borrow a
buffer of a GradWindow (sltune.runtime.disk.gradwindow): an early step gives it back once the unit has stepped; a
deferred one spills them to a file on the stepping thread as they arrive (their squared norm taken on the way),
and after the backward reads them back one unit ahead, scaled by the clipping and unscaling coefficient.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from sltune.runtime.disk.state import Block, DiskState, Stepped
from sltune.runtime.disk.gradwindow import GradWindow
from sltune.runtime.hostheap import release_freed
from sltune.runtime.regions import region
from sltune.runtime.spans import union_length
from sltune.runtime.disk.weightfiles import WeightFiles, placeholder


@dataclass
class StepTimeline:
    """Where one step's optimizer work went, in seconds, and how much of the disk's time the step did not wait
    for (bench/disk.py reports it)."""

    optimizer_s: float = 0.0        # the stepping thread computing (the optimizer and the dtype refresh)
    waited_s: float = 0.0           # the main thread waiting after the backward, for stepping and the disk
    exposed_s: float = 0.0          # ... while no stepping ran: waiting for the disk alone
    disk_busy_s: float = 0.0        # wall time with a read or a write in flight
    read_busy_s: float = 0.0        # wall time with a read in flight
    write_busy_s: float = 0.0       # wall time with a write in flight
    early: bool = False             # stepped during the backward

    @property
    def disk_hidden(self) -> float | None:
        """The share of the disk's busy time the step did not wait for."""
        if self.disk_busy_s <= 0:
            return None
        return max(0.0, 1.0 - self.exposed_s / self.disk_busy_s)


@contextlib.contextmanager
def only(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> Iterator[None]:
    """The optimizer's groups hold just these parameters for the block (hyperparameters and state untouched)."""
    keep = {id(p) for p in params}
    saved = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in keep]
    try:
        yield
    finally:
        for group, ps in zip(optimizer.param_groups, saved):
            group["params"] = ps


class UnitStepper:
    """Steps the optimizer unit by unit on a thread of its own; under disk, through DiskState's window."""

    def __init__(self, optimizer: torch.optim.Optimizer, stepped: dict[int, list[Stepped]],
                 disk: DiskState | None, master_in_memory: bool, rollback: bool,
                 weights: WeightFiles | None = None, grads: GradWindow | None = None):
        """`stepped`: per unit (by id) the tensors the optimizer steps. `master_in_memory`: refresh a unit's dtype
        copy from its float32 master after it steps (host mode). `rollback`: a failed step can be undone (the
        master lives on disk), so stepping may start during the backward. `weights` (param_offload disk, with
        `disk`): each stepped unit's dtype copy is written to its next file version. `grads`: the units' gradients
        borrow its buffers (param_offload disk) instead of living in buffers of their own."""
        self.optimizer = optimizer
        self.stepped = stepped
        self.disk = disk
        self.master_in_memory = master_in_memory
        self.rollback = rollback
        self.weights = weights
        self.grads = grads
        self.timeline = StepTimeline()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="sltune-step")
        self._order: list[Any] = []
        self._submitted: set[int] = set()
        self._futures: list[Future] = []
        self._done_blocks: list[Block] = []
        self._compute: list[tuple[float, float]] = []
        self._snapshot: dict[int, dict[str, Any]] = {}
        self._abort = threading.Event()
        self.early = False
        self._need_norm = False
        self._coef = 1.0
        self._committed = False
        self._counters: dict[int, dict[str, Any]] = {}      # a sliced tensor's counters before its first slice

    def blocks(self, unit) -> list[Block] | list[list[Stepped]]:
        if self.disk is not None:
            return self.disk.blocks_of(unit)
        return [self.stepped[id(unit)]]

    @property
    def pending_blocks(self) -> list[Block]:
        """Blocks this step has stepped on disk that are neither committed nor rolled back: [] between steps."""
        return list(self._done_blocks)

    def wait_stepped(self, count: int = 1) -> None:
        """Until the first `count` units handed over this step have stepped (or failed): what a step failed part-way
        on purpose waits for, so that there is something to roll back."""
        for fut in self._futures[:count]:
            fut.result()

    # -- the engine's calls ----------------------------------------------------------------------------
    def begin(self, order: Sequence[Any], early: bool, need_norm: bool = False) -> None:
        """A step starts: `order` is the units whose gradients will become final, in that order; `need_norm`: an
        early step takes the norm of the gradients in a GradWindow before their buffers go back."""
        self._order = [u for u in order if self.stepped.get(id(u))]
        self._submitted, self._futures, self._done_blocks, self._compute = set(), [], [], []
        self._abort.clear()
        self._committed = False
        self.early, self._need_norm, self._coef = early, need_norm, 1.0
        if self.grads is not None:
            self.grads.begin()
        self.timeline = StepTimeline(early=early)
        if self.rollback or self.weights is not None:    # the weights files roll back: so do the counters
            self._snapshot = {id(s.param): {k: (v.clone() if torch.is_tensor(v) else v)
                                            for k, v in self.optimizer.state[s.param].items()}
                              for u in self._order for s in self.stepped[id(u)] if s.param in self.optimizer.state}
        if self.disk is not None:
            self.disk.begin([b for u in self._order for b in self.disk.blocks_of(u)])

    def ready(self, unit, pending=None) -> None:
        """The unit's gradients are final (`pending`: their copy to the host, when it is asynchronous)."""
        if not self.stepped.get(id(unit)) or id(unit) in self._submitted:
            return
        if not self.early:
            if self.grads is not None:      # deferred: out of its buffer into a file, the norm taken on the way
                self._futures.append(self._worker.submit(self._guarded, self._spill_unit, unit, pending))
            return
        expected = next(u for u in self._order if id(u) not in self._submitted)
        if expected is not unit:
            raise RuntimeError(f"{unit.name}'s gradients became final before {expected.name}'s: the stepping order "
                               "does not follow the backward's")
        self._submit(unit, pending)

    def settle(self) -> None:
        """Wait for the work submitted so far: under a deferred step with a GradWindow, every unit's gradients
        spilled and their squared norms taken, so the norm can be decided."""
        with region("disk", "grad_spill"):
            for fut in self._futures:
                fut.result()

    def finish(self, coef: float = 1.0) -> None:
        """Step what has not stepped yet, wait for every unit and write, and commit the new version. `coef`:
        what spilled gradients are multiplied by as they come back (finish_grads's unscale and clip)."""
        start = time.perf_counter()
        self._coef = coef
        if self.grads is not None and not self.early and self._order:
            self.grads.request(self._order[0])
        with region("cpu", "optimizer_wait"):
            for unit in self._order:
                if id(unit) not in self._submitted:
                    self._submit(unit, None)
            for fut in self._futures:
                fut.result()
        if self.disk is not None:
            with region("disk", "write_behind"):        # the breakdown's disk slice
                self.disk.finish_writes()
                if self.weights is not None:
                    self.weights.finish()
                end = time.perf_counter()
                self.disk.commit(self.optimizer.state_dict())
                self._committed = True          # from here the step stands: nothing to roll back
                if self.weights is not None:
                    self.weights.commit()
        else:
            end = time.perf_counter()
        if self.grads is not None:
            self.grads.reset()
        self._account(start, end)

    def skip(self) -> None:
        """No step this time (float16 overflow): the read-ahead and the spilled gradients are dropped."""
        if self.disk is not None:
            self.disk.abort()
        if self.weights is not None:
            self.weights.abort()
        if self.grads is not None:
            self.grads.reset()

    def abort(self) -> None:
        """A failed step: stop stepping, drop what this step wrote, and undo what it stepped where the master is
        on disk."""
        self._stop(RuntimeError("the step was abandoned"))
        for fut in self._futures:
            fut.cancel()
        for fut in self._futures:
            with contextlib.suppress(BaseException):
                fut.result()
        if self.grads is not None:
            self.grads.reset()
        if self.disk is None or self._committed:
            return
        self.disk.abort()
        if self.weights is not None:        # the committed copies were never replaced
            self.weights.abort()
            self._done_blocks = []
        elif not self.rollback:
            return
        # torn (disk_versions 1 dropped files of the committed version): nothing to restore from; the engine
        # refuses to step, save or read masters from here (DiskState.torn)
        for block in self._done_blocks if self.disk.torn is None else []:
            for s, master in zip(block.items, self.disk.read_block(block).masters):
                s.unit.host[s.offset:s.offset + s.numel].copy_(master.reshape(-1))
        for unit in self._order:
            for s in self.stepped[id(unit)]:
                s.param.data, s.param.grad = s.placeholder(), None
                state = self._snapshot.get(id(s.param))
                if state is None:
                    self.optimizer.state.pop(s.param, None)
                else:
                    self.optimizer.state[s.param] = state
        self._done_blocks = []

    # -- the stepping thread ---------------------------------------------------------------------------
    def _submit(self, unit, pending) -> None:
        self._submitted.add(id(unit))
        self._futures.append(self._worker.submit(self._guarded, self._step_unit, unit, pending))

    def _guarded(self, job, unit, pending) -> None:
        """A job of the stepping thread; its failure stops the jobs after it (they would wait for blocks left in
        the window's slots) and wakes the backward if it waits for a gradient buffer. What the job freed (the
        optimizer's temporaries, its first step's fresh state) goes back to the system (sltune.runtime.hostheap):
        left in malloc's arenas it added 1.7 GiB to a qwen2-0.5b step's peak."""
        try:
            job(unit, pending)
        except BaseException as err:
            self._stop(err)
            raise
        finally:
            release_freed()

    def _stop(self, error: BaseException) -> None:
        """No more stepping this step: the jobs queued return, and whoever waits for the disk or a gradient buffer
        raises."""
        self._abort.set()
        if self.disk is not None:
            self.disk.interrupt(error)
        if self.grads is not None:
            self.grads.fail(error)

    def _spill_unit(self, unit, pending) -> None:
        if self._abort.is_set():
            return
        _landed(pending)
        self.grads.account(unit)
        with region("disk", "grad_spill"):
            self.grads.spill(unit)

    def _step_unit(self, unit, pending) -> None:
        if self._abort.is_set():
            return
        _landed(pending)
        if self.grads is not None:
            self._borrowed_grads(unit)
        if self.weights is not None and self.disk is not None:
            self._step_unit_on_disk(unit)
            if self.grads is not None:
                self.grads.release(unit)
            return
        for block in self.blocks(unit):
            if self._abort.is_set():
                return
            if self.disk is None:
                start = time.perf_counter()
                with region("cpu", "optimizer"), only(self.optimizer, [s.param for s in block]):
                    self.optimizer.step()
                if self.master_in_memory:
                    unit.host.copy_(unit.master)
                self._compute.append((start, time.perf_counter()))
            else:
                self._step_block(block)

    def _step_unit_on_disk(self, unit) -> None:
        """A unit whose dtype copy is a file: stepped into a window buffer, which is written behind. Without a
        master the model's own Parameters are stepped, bound to the buffer's views for the time of the step."""
        stepped = self.stepped[id(unit)]
        no_master = self.disk.master is False
        numel = unit.host.numel()      # the placeholder's: the unit's values in its file (a rank's shard, sharded)
        buf = self.weights.stage(unit, with_values=no_master or sum(s.numel for s in stepped) < numel)
        values = buf[:numel * unit.host.dtype.itemsize].view(unit.host.dtype)
        try:
            if no_master:
                for s in stepped:
                    s.param.data = values[s.offset:s.offset + s.numel].view(s.shape)
            for block in self.disk.blocks_of(unit):
                if self._abort.is_set():
                    self.weights.give_back(buf)
                    return
                self._step_block(block, values)
        except BaseException:
            self.weights.give_back(buf)
            raise
        finally:
            if no_master:
                for s in stepped:
                    s.param.data = placeholder(s.shape, values.dtype)
        self.weights.write_behind(unit, buf)

    def _step_block(self, block: Block, values: torch.Tensor | None = None) -> None:
        slot = self.disk.wait(block)
        try:
            self._step_in(block, slot, values)
        except BaseException:       # the slot goes back to the window, or the blocks after it wait forever
            self.disk.release(slot)
            raise
        self.disk.write_behind(block, slot)

    def _step_in(self, block: Block, slot, values: torch.Tensor | None = None) -> None:
        """Step a block in its slot; the dtype copy refreshed from the new master into `values` (the unit's
        staged copy under param_offload disk), else into the unit's host buffer."""
        disk, opt = self.disk, self.optimizer
        start = time.perf_counter()
        self._done_blocks.append(block)          # from here its dtype copy may change: roll it back if need be
        views = disk.views(block, slot)
        params, wholes = [], {}
        for s, master, states in zip(block.items, views.masters, views.states):
            p = s.param
            if s.part is not None:
                self._slice_counters(s)
                if master is None:      # the values stepped in place: the slice of the tensor's
                    wholes[id(p)] = p.data
                    p.data = p.data.reshape(-1)[s.part:s.part + s.numel]
            if master is not None:
                p.data = master
            p.grad = s.grad
            if block.has_state:
                state = opt.state[p]
                for (key, _), t in zip(disk.layout, states):
                    state[key] = t
            params.append(p)
        try:
            with region("cpu", "optimizer"), only(opt, params):
                opt.step()
        finally:
            for p in params:
                if id(p) in wholes:
                    p.data = wholes[id(p)]
        for s, master, states in zip(block.items, views.masters, views.states):
            state = opt.state[s.param]
            for (key, _), t in zip(disk.layout, states):
                if key not in state:
                    raise RuntimeError(f"the optimizer keeps no {key!r} for a tensor it stepped; optimizer_offload "
                                       "disk needs an element-wise optimizer whose state is shaped like its "
                                       "parameters (AdamW, SGD)")
                new = state.pop(key)
                if new.data_ptr() != t.data_ptr():       # made by the optimizer (its first step): into the slot
                    t.copy_(new)
            if master is not None:
                target = values if values is not None else s.unit.host
                target[s.offset:s.offset + s.numel].copy_(master.reshape(-1))
                s.param.data = s.placeholder()
            s.param.grad = None
        self._compute.append((start, time.perf_counter()))

    def _slice_counters(self, s: Stepped) -> None:
        """A tensor stepped slice by slice takes one step: every slice starts from the counters (AdamW's `step`)
        the tensor had before its first slice stepped."""
        state = self.optimizer.state[s.param]
        layout = {key for key, _ in self.disk.layout}
        if s.part == 0:
            self._counters[id(s.param)] = {k: v.clone() if torch.is_tensor(v) else v
                                           for k, v in state.items() if k not in layout}
            return
        state.clear()
        state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in self._counters[id(s.param)].items()})

    def _borrowed_grads(self, unit) -> None:
        """The unit's gradients in their buffer, ready to step: early, their norm taken when asked; deferred, read
        back (the next unit's read started first) and scaled."""
        if self.early:
            if self._need_norm:
                self.grads.account(unit)
            return
        at = next(i for i, u in enumerate(self._order) if u is unit)
        if at + 1 < len(self._order):
            self.grads.request(self._order[at + 1])
        with region("disk", "grad_read"):
            flat = self.grads.restore(unit)
        if self._coef != 1.0:
            flat.mul_(self._coef)

    # -- the timeline ----------------------------------------------------------------------------------
    def _account(self, start: float, end: float) -> None:
        t = self.timeline
        t.optimizer_s = sum(b - a for a, b in self._compute)
        t.waited_s = end - start
        t.exposed_s = (end - start) - union_length((max(a, start), min(b, end)) for a, b in self._compute
                                                   if b > start and a < end)
        if self.disk is not None:
            times = self.disk.times
            t.read_busy_s = union_length(times.reads)
            t.write_busy_s = union_length(times.writes)
            t.disk_busy_s = union_length(times.reads + times.writes)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _landed(pending) -> None:
    """Wait for the gradients' copy to the host, when it is asynchronous."""
    event = getattr(pending, "event", None)
    if event is not None:
        event.synchronize()
