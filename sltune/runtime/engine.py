"""SpeedLoaderEngine: trains a transformers causal LM whose weights live in host memory.

One training step, per the SpeedLoader method (../shared/design/speedloader.md), with G groups of
num_live_blocks layers plus the embedding and the head as units:

    forward    the embedding, then each group but the last: load it once, run all N sub-batches through it,
               offload each output (the next group's input)
    turnaround the last group and the head, live together: per sub-batch forward, loss and backward at once
               (no recompute and no boundary round trip for that edge)
    backward   each group below in reverse: load it once, per sub-batch take its output's gradient and
               backpropagate; gradients accumulate on the device and are offloaded once
    embedding  its forward kept its autograd graph (token ids, at most a dropout mask): the backward
               recomputes nothing
    optimizer  the user's optimizer steps the host parameters

sltune.runtime.phases plans these phases; the expected traffic and the tuner's prior walk the same plan.

How a group's backward gets its forward's intermediates is the `activations` knob:
    recompute  it re-runs the forward from the group's stored input (dropout replays its RNG state); device
               memory holds one group's intermediates for one sub-batch
    offload    the forward ran with autograd and its saved tensors went to host memory (sltune.runtime.saved),
               loaded back one sub-batch ahead of the backward; parameters among them are re-bound to the
               unit's reloaded buffer, not copied. Nothing is recomputed; host memory and traffic grow

The "canonical" schedule runs the same pass once per micro-batch (every micro-batch loads every unit,
gradients offloaded and added on the host each time: ZeRO-Offload's traffic), keeping activations (and under
offload the saved tensors) on the device. "resident" keeps everything on the device and runs plain autograd
through the whole model per sub-batch: the no-I/O, no-recompute bound, whatever `activations` says.

Bytes per step, per channel, in each schedule (the parameter loads, the gradient offloads, the boundary
activations and saved tensors, the disk tier's files, the collectives): sltune.runtime.traffic, which computes them
(`expected_io()`); the tests hold the counters to them.

`generate()` runs the same inversion for decoding (sltune.runtime.generate, which says what a call moves): per
step each unit loads once and every sub-batch passes through it with its own KV cache, in host or device memory as
kv_cache says (sltune.runtime.kvcache); weights_on_device keeps a share of the units on the device for the whole
call.

generate.py does not import this module: it names what it uses as generate.Runtime.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from sltune.config import SpeedLoaderConfig, param_offload_refusal
from sltune.models.checkpoint import Checkpoint, materialize, untied, write_pretrained
from sltune.runtime.activations import DeviceActivations, HostActivations
from sltune.runtime.device import check_device, check_dtype
from sltune.runtime.disk.state import DiskState, state_layout
from sltune.runtime import phases, traffic
from sltune.runtime.family import CausalLM, LayerCall, unique_params
from sltune.runtime.hostheap import release_freed
from sltune.runtime.inputs import IGNORE_INDEX, check_batch, check_prompt
from sltune.runtime.kvcache import kv_store
from sltune.runtime.memory import DeviceMemory, monitor_for
from sltune.runtime.params import BufferPool, ParamStore, ParamUnit
from sltune.runtime.residency import keep_order, kept_share
from sltune.runtime.rowgrads import row_embedding, sparse_rows, take_rows
from sltune.runtime.precision import GradStep, LossScaler, finish_grads, warn_vanishing_eps
from sltune.runtime.regions import region, step_region
from sltune.runtime.rngstash import RngStash
from sltune.runtime.saved import KeptGraph, SavedTensors
from sltune.runtime.sharding import ShardedParamStore
from sltune.runtime.stepping import StepTimeline, UnitStepper
from sltune.runtime.counters import IOCounters
from sltune.runtime.transfer import Copier
from sltune.runtime.disk.weightfiles import WeightFiles

if TYPE_CHECKING:
    from sltune.models.seeded import SeededWeights
    from sltune.runtime.generate import GenerationStats

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class StepResult:
    loss: float
    tokens: int
    seconds: float
    io: IOCounters
    peak_device_bytes: int | None = None   # measured on this step, or on the first step of this shape
    grad_norm: float | None = None         # the unscaled global norm before clipping, when it was computed
    skipped: bool = False                  # float16: the gradients overflowed, no optimizer step was taken
    loss_scale: float | None = None        # float16: the scale this step's loss was multiplied by


@dataclass
class _SubBatch:
    ids: torch.Tensor
    labels: torch.Tensor | None
    mask: torch.Tensor | None
    calls: list[LayerCall] = field(default_factory=list)


@dataclass
class _Group:
    index: int
    first: int
    last: int
    unit: ParamUnit


class SpeedLoaderEngine:
    """Wraps a transformers causal LM; the model keeps its code, its parameters and their names."""

    def __init__(self, model: nn.Module, config: SpeedLoaderConfig | dict,
                 optimizer: OptimizerFactory | None = None, *, max_grad_norm: float | None = None,
                 track_grad_norm: bool = False, weights: "Checkpoint | SeededWeights | None" = None,
                 overlap_optimizer: bool | None = None):
        """`optimizer` builds the host optimizer from the parameters it steps (the float32 masters under mixed
        precision); None: an engine that only generates. `max_grad_norm` clips the global gradient norm as
        torch.nn.utils.clip_grad_norm_ on the whole model; `track_grad_norm` reports it without clipping.
        `weights`: what fills the parameters (meta ones included): a checkpoint (from_pretrained) or
        sltune.models.seeded.SeededWeights (a trial's). `overlap_optimizer`: step each unit on a thread as soon
        as its gradients are final, during the backward (sltune.runtime.stepping), where no clipping or loss
        scaling needs every gradient first; default: under optimizer_offload disk (whose files let a failed step
        roll back), not under host (a step that fails part-way would leave some units stepped)."""
        self.config = config = _runnable(config, max_grad_norm)
        self.device = check_device(config.device)
        self.dtype = getattr(torch, config.dtype)
        check_dtype(self.device, self.dtype)
        if config.device_memory_limit is not None and config.memory_tracking == "never" \
                and self.device.type != "cuda":
            raise ValueError("device_memory_limit needs memory_tracking 'first' or 'always' on the CPU")
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if config.world_size is not None and config.world_size != self.world:
            raise ValueError(f"the config was made for world_size {config.world_size} but this process group has "
                             f"{self.world} ranks; launch {config.world_size} ranks or set world_size: null")
        if self.world > 1 and config.schedule == "resident":
            raise ValueError("the resident schedule keeps every parameter on every device; with torch.distributed "
                             "use schedule 'speedloader' or 'canonical'")
        self.lm = CausalLM(model)
        self.model = model
        if weights is not None:
            materialize(model)
        self.checkpoint = weights if isinstance(weights, Checkpoint) else None   # the folder saves default to

        self.io = IOCounters()
        self.memory: DeviceMemory = monitor_for(self.device, config.device_memory_limit)
        self.copier = Copier(self.device, self.io)
        self.pool = BufferPool(self.device, self.memory, self.copier.streams)
        self._build_units()
        resident = config.schedule == "resident"
        train = optimizer is not None
        if why := param_offload_refusal(config.param_offload, config.optimizer_offload, train):
            raise ValueError(why)
        rank = dist.get_rank() if self.world > 1 else 0
        # optimizer_offload disk: the masters and the optimizer state in files (resident is refused by the config)
        self.disk = DiskState(config.offload_dir, self.io, master=config.has_master, rank=rank,
                              versions=config.disk_versions) \
            if train and config.optimizer_offload == "disk" else None
        # param_offload disk: the dtype copies (sharded: this rank's shards) in files beside the disk tier's
        # (sltune.runtime.disk.weightfiles)
        self.weights = WeightFiles(config.offload_dir, self.io, self.disk, rank=rank) \
            if config.param_offload == "disk" else None
        with weights.reader(model) if weights else contextlib.nullcontext() as fill:
            store = dict(train=train, master=config.has_master, fill=fill,
                         on_device_accumulate=config.schedule != "canonical", disk=self.disk)
            if self.world > 1:
                self.params = ShardedParamStore(self.units, self.dtype, self.copier, self.pool, weights=self.weights,
                                                **store)
            else:
                self.params = ParamStore(self.units, self.dtype, self.copier, self.pool, resident=resident,
                                         weights=self.weights, **store)
        # the parameters point at the store's dtype copies now; buffers keep their dtype, as transformers keeps
        # them for a bfloat16 model (rotary frequencies stay float32)
        if self.device.type != "cpu":
            _move_buffers(model, self.device)
        self.acts = HostActivations(self.copier, self.memory) if config.schedule == "speedloader" \
            else DeviceActivations()
        self.saved = SavedTensors(self.copier, self.memory, self.pool,
                                  host=config.schedule == "speedloader" and config.activations == "offload")
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        self.kv = kv_store(config.schedule, config.kv_cache, self.copier, self.pool, self.memory)
        self.last_generation: "GenerationStats | None" = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.max_grad_norm = max_grad_norm
        self.track_grad_norm = track_grad_norm
        self.scaler = LossScaler() if train and config.has_master and self.dtype == torch.float16 else None
        if optimizer is not None:
            self.optimizer = self._build_optimizer(optimizer)
        overlap = self.disk is not None if overlap_optimizer is None else overlap_optimizer
        # per-unit stepping: always under disk (early when it can roll back), under host when asked to overlap
        self.stepper = UnitStepper(self.optimizer, self.params.stepped, self.disk,
                                    master_in_memory=self.params.master and self.disk is None,
                                    rollback=self.params.master_on_disk, weights=self.weights,
                                    grads=self.params.grads) \
            if self.optimizer is not None and not resident and (self.disk is not None or overlap) else None
        self._overlap = overlap
        self.last_stepping: StepTimeline | None = None
        self._measured: dict[tuple, int] = {}
        release_freed()     # the build's temporaries (sltune.runtime.hostheap)

    def _build_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The host optimizer over what is stepped: sharded, this rank's flat shard of each unit (the same update
        for element-wise optimizers); under mixed precision the float32 masters, in the model's parameter order."""
        if self.world > 1:
            stepped = self.params.shard_params
        else:
            trainable = [p for p in unique_params(self.model.parameters()) if p.requires_grad]
            masters = self.params.master_params()
            stepped = [masters[id(p)] for p in trainable] if masters else trainable
        opt = factory(stepped)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
        if not self.config.has_master:
            warn_vanishing_eps(opt, self.dtype)
        if self.disk is not None:
            self.disk.configure(state_layout(factory, torch.float32 if self.config.has_master else self.dtype), opt)
        return opt

    @classmethod
    def from_pretrained(cls, path: str | Path, config: SpeedLoaderConfig | dict,
                        optimizer: OptimizerFactory | None = None, seed: int = 0, **kwargs) -> "SpeedLoaderEngine":
        """An engine over a Hugging Face folder's model: its config.json, and its safetensors read straight into
        the engine's buffers (the model is built on the meta device; nothing is initialised twice). A folder
        with a config and no weights gets seeded random weights instead."""
        checkpoint = Checkpoint(path)
        if not checkpoint.has_weights:
            from sltune.models import build

            return cls(build(checkpoint.config, seed=seed), config, optimizer, **kwargs)
        return cls(checkpoint.empty_model(), config, optimizer, weights=checkpoint, **kwargs)

    def save_pretrained(self, path: str | Path, dtype: str | torch.dtype | None = None,
                        max_shard_size: int | str = "5GB", state: dict[str, torch.Tensor] | None = None) -> list[Path]:
        """Write the current weights as a Hugging Face folder AutoModelForCausalLM.from_pretrained loads:
        safetensors (sharded with an index above max_shard_size), config.json, and the tokenizer files of the
        folder the weights came from. dtype defaults to the source checkpoint's, else the weights' own (the
        float32 master under mixed precision). Sharded, a collective; rank 0 writes."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if dtype is None:
            source = self.checkpoint.dtype if self.checkpoint is not None else None
            dtype = source or (torch.float32 if self.params.master else self.dtype)
        state = self.untied(self.state_dict() if state is None else state)  # state: a state_dict() already gathered
        files: list[Path] = []
        if self.world == 1 or dist.get_rank() == 0:
            files = write_pretrained(path, self.model, state, dtype, max_shard_size,
                                     source=self.checkpoint.path if self.checkpoint is not None else None)
        if self.world > 1:
            dist.barrier()
        return files

    def untied(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state_dict with a tied weight once, under its first name, as transformers saves it."""
        return untied(self.model, state)

    # -- units -------------------------------------------------------------------------------------
    def _build_units(self) -> None:
        prologue, layers, head = self.lm.param_groups()
        tied_ids = {id(p) for p in prologue} & {id(p) for p in head}
        k = self.config.num_live_blocks
        self.embed = ParamUnit("embed", [p for p in prologue if id(p) not in tied_ids])
        self.groups = [
            _Group(a // k, a, min(a + k, len(layers)),
                   ParamUnit(f"layers[{a}:{min(a + k, len(layers))}]", [p for ps in layers[a:a + k] for p in ps]))
            for a in range(0, len(layers), k)
        ]
        self.head = ParamUnit("head", [p for p in head if id(p) not in tied_ids])
        self.tied = ParamUnit("tied", [p for p in prologue if id(p) in tied_ids])
        for g in self.groups:
            g.unit.parts = [0, *itertools.accumulate(sum(p.numel() for p in layers[i]) for i in range(g.first, g.last))]
        self.units = [self.embed, *(g.unit for g in self.groups), self.head, self.tied]

    # -- training ----------------------------------------------------------------------------------
    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None) -> StepResult:
        """One optimizer step on b*N rows; the loss is the model's mean token loss over all of them."""
        if self.optimizer is None:
            raise ValueError("this engine was built with optimizer=None and can only generate; "
                             "pass optimizer=lambda params: torch.optim.AdamW(params, lr=...) to train")
        ids, labels, mask = check_batch(input_ids, labels, attention_mask, self.config, self.lm.config, self.device)
        start = time.perf_counter()
        before = self.io.copy()
        shape = tuple(ids.shape)
        mode = self.config.memory_tracking
        track = mode == "always" or (mode == "first" and shape not in self._measured)
        try:
            with step_region(), self.memory.tracking(track):
                loss, grads = self._train(ids, labels, mask)
        except BaseException:
            self._recover()
            raise
        if track or self.device.type == "cuda":
            self._measured[shape] = self.memory.peak
        release_freed()     # the step's freed temporaries back to the system, counted in its time
        return StepResult(loss=loss, tokens=ids.numel(), seconds=time.perf_counter() - start,
                          io=self.io - before, peak_device_bytes=self._measured.get(shape), grad_norm=grads.norm,
                          skipped=grads.skip, loss_scale=self._scale_used)

    def _train(self, ids: torch.Tensor, labels: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[float, GradStep]:
        b, n = self.config.sub_batch_size, self.config.num_sub_batches
        num_items = (labels[:, 1:] != IGNORE_INDEX).sum()
        if self.world > 1:     # the loss is the mean over the union of every rank's batch
            dist.all_reduce(num_items)
        num_items = int(num_items)
        subs = [_SubBatch(ids[i * b:(i + 1) * b], labels[i * b:(i + 1) * b],
                          None if mask is None else mask[i * b:(i + 1) * b]) for i in range(n)]
        self._rng = RngStash(self.device, enabled=self.model.training)
        self._scale_used = self.scaler.scale if self.scaler is not None else None
        self.saved.start_step()
        stepper = self.stepper
        step = self.step_plan()
        if stepper is not None and (step.early or self.disk is not None):
            stepper.begin(step.step_order, step.early, need_norm=self.track_grad_norm)
        else:
            stepper = None
        if self.config.schedule == "canonical":
            loss = sum(self._pass([sb], num_items, accumulate=j > 0, final=j == n - 1) for j, sb in enumerate(subs))
        elif self.config.schedule == "resident":
            self.params.drop_resident_grads()
            loss = self._resident(subs, num_items)
        else:
            loss = self._pass(subs, num_items, accumulate=False)
        self.copier.synchronize()
        host_side = self.config.schedule != "resident"
        streamed = self.params.grads        # param_offload disk: the norm was taken as the gradients streamed by
        with self.memory.paused() if host_side else contextlib.nullcontext(), \
                region("cpu" if host_side else "compute", "optimizer"):
            if step.early:       # the units stepped (or are stepping) already; the norm of what they stepped with
                stepper.finish()
                grads = finish_grads(self.params.grad_buffers(), need_norm=self.track_grad_norm, world=self.world,
                                     square=streamed.square(self.units) if streamed is not None else None)
            else:
                if streamed is not None:
                    stepper.settle()
                grads = finish_grads(self.params.grad_buffers(), scale=self._scale_used or 1.0,
                                     max_norm=self.max_grad_norm, need_norm=self.track_grad_norm, world=self.world,
                                     square=streamed.square(self.units) if streamed is not None else None)
                if stepper is not None:
                    stepper.skip() if grads.skip else stepper.finish(grads.coef)
                elif not grads.skip:
                    self.optimizer.step()
                    self.params.refresh()
        self.last_stepping = stepper.timeline if stepper is not None else None
        if self.scaler is not None:
            self.scaler.update(grads.skip)
            if grads.skip:
                warnings.warn(f"float16 gradients overflowed at loss scale {self._scale_used:g}: step skipped, "
                              f"scale now {self.scaler.scale:g}", RuntimeWarning, stacklevel=3)
        if self.world > 1:
            dist.all_reduce(loss)
        return float(loss), grads

    def _whole(self) -> None:
        """A torn engine (a step failed mid-way under disk_versions 1) holds partly stepped weights: evaluating or
        generating with them would answer for no model, so it refuses, as a step or a save does."""
        if self.disk is not None:
            self.disk.check_whole()

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> float:
        """The mean token loss on b*N rows without training: each unit loaded once, every sub-batch through it
        (sharded, over the union of the ranks' rows). Dropout is off while it runs."""
        self._whole()
        ids, labels, mask = check_batch(input_ids, labels, attention_mask, self.config, self.lm.config, self.device)
        b, n = self.config.sub_batch_size, self.config.num_sub_batches
        num_items = (labels[:, 1:] != IGNORE_INDEX).sum()
        if self.world > 1:
            dist.all_reduce(num_items)
        subs = [_SubBatch(ids[i * b:(i + 1) * b], labels[i * b:(i + 1) * b],
                          None if mask is None else mask[i * b:(i + 1) * b]) for i in range(n)]
        training = self.model.training
        self.model.eval()
        self._rng = RngStash(self.device, enabled=False)
        store, lm = self.params, self.lm
        *body, last = self.groups
        trains = [False] * (len(self.groups) + 1)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        try:
            with torch.no_grad(), step_region():
                self.acts.prepare(len(self.groups), n, (*subs[0].ids.shape, lm.config.hidden_size), self.dtype)
                store.activate(self.tied)
                for unit, run in [(self.embed, lambda: self._embed_forward(subs, trains, {})),
                                  *((g.unit, lambda g=g: self._group_forward(g, subs, trains, {})) for g in body)]:
                    store.activate(unit)
                    run()
                    store.release(unit)
                store.activate(last.unit)
                store.activate(self.head)
                for i, (x, _) in self._each(last.index, None, n):
                    with region("compute", "eval"):
                        y = lm.run_layers(last.first, last.last, x.wait(), subs[i].calls)
                        loss += lm.loss(lm.logits(y), subs[i].labels, int(num_items)).float()
                for unit in (last.unit, self.head, self.tied):
                    store.release(unit)
        except BaseException:
            self._recover()
            raise
        finally:
            self.acts.clear()
            self.model.train(training)
        if self.world > 1:
            dist.all_reduce(loss)
        return float(loss)

    def _resident(self, subs: list[_SubBatch], num_items: int) -> torch.Tensor:
        """Plain autograd through the whole model per sub-batch: nothing recomputed, nothing copied."""
        lm, losses = self.lm, []
        for sb in subs:
            with torch.enable_grad(), region("compute", "resident"):
                hidden, calls = lm.prologue(sb.ids, sb.mask, use_cache=False)
                y = lm.run_layers(0, len(lm.layers), hidden, calls)
                loss = lm.loss(lm.logits(y), sb.labels, num_items)
                if loss.requires_grad:
                    self._scaled(loss).backward()
            self.params.flush_grads(self.units)
            losses.append(loss.detach())
        return torch.stack(losses).sum()

    def _pass(self, subs: list[_SubBatch], num_items: int, accumulate: bool, final: bool = True) -> torch.Tensor:
        """Forward, turnaround and backward of every unit over these sub-batches; gradients to the host (`final`:
        the step's last pass, after which each unit's offloaded gradients are final)."""
        store = self.params
        hidden = self.lm.config.hidden_size
        self.acts.prepare(len(self.groups), len(subs), (*subs[0].ids.shape, hidden), self.dtype)
        trains, plan = self._plan()
        live = [[self._unit(u) for u in phase.units] for phase in plan]
        graphs: dict = {}            # kept forward graphs, by (unit key, sub-batch), until their backward
        losses: list[torch.Tensor] = []
        store.activate(self.tied)
        store.begin_grads(self.tied)
        for idx, phase in enumerate(plan):
            kind, units = phase.kind, live[idx]
            group = None if phase.group is None else self.groups[phase.group]
            for unit in units:
                store.activate(unit)
            if idx + 1 < len(plan):
                for unit in live[idx + 1]:
                    store.prefetch(unit)
            backward = phase.backward
            if backward:
                for unit in units:
                    store.begin_grads(unit)
            if kind == "embed_fwd":
                self._embed_forward(subs, trains, graphs)
            elif kind == "fwd":
                self._group_forward(group, subs, trains, graphs)
            elif kind == "turn":
                losses += self._turnaround(group, subs, trains, num_items)
            elif kind == "bwd":
                self._group_backward(group, subs, trains, graphs)
            else:
                self._embed_backward(subs, graphs)
            for unit in units:
                if backward:
                    copied = store.offload_grads(unit, accumulate)
                    if final and self.stepper is not None:
                        self.stepper.ready(unit, copied)
                store.release(unit)
        copied = store.offload_grads(self.tied, accumulate)
        if final and self.stepper is not None:
            self.stepper.ready(self.tied, copied)
        store.release(self.tied)
        self.saved.clear()
        return torch.stack(losses).sum()

    def _embed_forward(self, subs: list[_SubBatch], trains: list[bool], graphs: dict) -> None:
        """The prologue per sub-batch; its graph is kept (only token ids are saved, or the embedding's
        dropout mask) so the embedding's backward recomputes nothing."""
        lm = self.lm
        rows = row_embedding(lm.model)
        for i, sb in enumerate(subs):
            with region("compute", "embed_fwd"):
                if trains[0]:
                    graph = graphs[("embed", i)] = KeptGraph(self._anchor)
                    with torch.enable_grad(), self.saved.keeping(("embed", i), (self.embed, self.tied)), \
                            sparse_rows(rows):
                        hidden, calls = lm.prologue(sb.ids, sb.mask, use_cache=False)
                        graph.output(hidden)
                else:
                    with torch.no_grad():
                        hidden, calls = lm.prologue(sb.ids, sb.mask, use_cache=False)
            sb.calls = [LayerCall(*detached((c.args, c.kwargs))) for c in calls]
            self.acts.put(0, i, hidden)

    def _group_forward(self, group: "_Group", subs: list[_SubBatch], trains: list[bool], graphs: dict) -> None:
        """Every sub-batch through a group below the last. `recompute` keeps no graph (the backward runs the
        forward again); `offload` keeps it, its saved tensors in host memory."""
        e, lm = group.index, self.lm
        keep = self.config.activations == "offload" and trains[e + 1]
        for i, (x, _) in self._each(e, None, len(subs)):
            x = x.wait()
            with region("compute", "fwd"):
                if keep:
                    graph = graphs[(e, i)] = KeptGraph(self._anchor)
                    with torch.enable_grad(), self.saved.keeping((e, i), (group.unit,)):
                        y = lm.run_layers(group.first, group.last, graph.input(x, trains[e]), subs[i].calls)
                        graph.output(y)
                else:
                    with torch.no_grad(), self._rng.save((e, i)):
                        y = lm.run_layers(group.first, group.last, x, subs[i].calls)
            self.acts.put(e + 1, i, y)

    def _turnaround(self, group: "_Group", subs: list[_SubBatch], trains: list[bool],
                    num_items: int) -> list[torch.Tensor]:
        """The last group and the head, live together: forward, loss and backward per sub-batch at once."""
        e, lm, losses = group.index, self.lm, []
        for i, (x, _) in self._each(e, None, len(subs)):
            x = x.wait().detach().requires_grad_(trains[e])
            with torch.enable_grad(), region("compute", "turn"):
                y = lm.run_layers(group.first, group.last, x, subs[i].calls)
                loss = lm.loss(lm.logits(y), subs[i].labels, num_items)
                if loss.requires_grad:
                    self._scaled(loss).backward()
            self.params.flush_grads((group.unit, self.head, self.tied))
            if x.grad is not None:
                self.acts.put(e, i, x.grad)
            losses.append(loss.detach())
        return losses

    def _group_backward(self, group: "_Group", subs: list[_SubBatch], trains: list[bool], graphs: dict) -> None:
        """Per sub-batch: the output's gradient in, the input's gradient out; params grads on the device."""
        e, lm = group.index, self.lm
        if self.config.activations == "offload":
            for i, (_, gy) in self._each(None, e + 1, len(subs), saved=e):
                with region("compute", "bwd"):
                    gx = graphs.pop((e, i)).backward(gy.wait())
                self.params.flush_grads((group.unit,))
                self.saved.release((e, i))
                if gx is not None:
                    self.acts.put(e, i, gx)
                self.acts.drop(e + 1, i)
            return
        for i, (x, gy) in self._each(e, e + 1, len(subs)):
            x = x.wait().detach().requires_grad_(trains[e])
            gy = gy.wait()
            with torch.enable_grad(), self._rng.replay((e, i)), region("compute", "bwd"):
                y = lm.run_layers(group.first, group.last, x, subs[i].calls)
                torch.autograd.backward(y, gy)
            self.params.flush_grads((group.unit,))
            if x.grad is not None:
                self.acts.put(e, i, x.grad)
            self.acts.drop(e + 1, i)

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward starts from: times the loss scale under float16 mixed precision."""
        return loss if self._scale_used is None else loss * self._scale_used

    def _embed_backward(self, subs: list[_SubBatch], graphs: dict) -> None:
        """Per sub-batch, the prologue's backward. The input embedding's gradient comes as the rows the sub-batch
        touched (sltune.runtime.rowgrads), added into the gradient already held, or by a master's flush into the
        float32 sum; a gradient still in rows after that (the step's first, without a master) is made dense."""
        rows = row_embedding(self.lm.model)
        w = None if rows is None else rows.weight
        for i, (_, gy) in self._each(None, 0, len(subs), saved="embed"):
            held = None
            if w is not None:
                held, w.grad = w.grad, None
            with region("compute", "embed_bwd"):
                graphs.pop(("embed", i)).backward(gy.wait())
                if w is not None:
                    take_rows(w, held)
            self.params.flush_grads((self.embed, self.tied))
            if w is not None and w.grad is not None and w.grad.is_sparse:
                w.grad = w.grad.to_dense()
            self.saved.release(("embed", i))
            self.acts.drop(0, i)

    def _plan(self) -> tuple[list[bool], list[phases.Phase]]:
        """The phases of a pass (sltune.runtime.phases.plan), and for each group edge whether a gradient must
        flow back through it.

        Backward through a unit is needed while a trainable parameter sits in it or before it: a frozen prefix of
        the model (fine-tuning the top layers) gets no backward, no loads and no copies for it. Sharded,
        `has_grads` is the same on every rank, so every rank runs the same collectives."""
        trains = phases.trained_edges(self.embed.has_grads or self.tied.has_grads,
                                      [g.unit.has_grads for g in self.groups])
        return trains, phases.plan(len(self.groups), trains)

    def _unit(self, unit: phases.Unit) -> ParamUnit:
        """The engine's unit a phase names: a group's index, or "embed", "head", "tied"."""
        if isinstance(unit, int):
            return self.groups[unit].unit
        return {"embed": self.embed, "head": self.head, "tied": self.tied}[unit]

    def _early(self) -> bool:
        """Whether a unit steps as soon as its gradients are final: not when the step needs all of them first
        (clipping, loss scaling), nor when a failure part-way could not be undone (the master in host memory, or
        none: the model's own Parameters are stepped, which the backward still uses)."""
        stepper = self.stepper
        return stepper is not None and self._overlap and self.scaler is None and self.max_grad_norm is None \
            and (stepper.rollback or self.disk is None)

    def step_plan(self) -> phases.StepPlan:
        """The plan a train_step runs now (it changes with what trains and how the step is set up)."""
        trains, plan = self._plan()
        return phases.StepPlan(tuple(trains), tuple(plan), tuple(self._unit(u) for u in phases.loaded(plan)),
                               tuple(self._unit(u) for u in phases.step_order(plan)), self._early())

    def _each(self, edge: int | None, grad_edge: int | None, n: int, saved=None) -> Iterator:
        """Sub-batch indices with their inputs fetched one ahead (the next copy overlaps this compute), and
        with `saved` (a unit key) that unit's saved tensors for the sub-batch too."""
        def fetch(i):
            if saved is not None:
                self.saved.prefetch((saved, i))
            return (None if edge is None else self.acts.fetch(edge, i),
                    None if grad_edge is None else self.acts.fetch(grad_edge, i))
        nxt = fetch(0)
        for i in range(n):
            cur = nxt
            if i + 1 < n:
                nxt = fetch(i + 1)
            yield i, cur

    def _recover(self) -> None:
        """After a failed step (out of memory, interrupt): parameters back on the host copy, unchanged (stepping
        per unit: undone where the master is on disk, sltune.runtime.stepping)."""
        if self.stepper is not None:
            self.stepper.abort()
        self.params.reset()
        self.acts.clear()
        self.saved.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- generation --------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 16, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> torch.Tensor:
        """Prompts [b*N, s] (left-padded, attention_mask 1 on real tokens) -> LongTensor [b*N, s + new].

        Greedy unless do_sample (temperature, then top_k, drawn from `generator`). Like transformers'
        generate, a row that produces eos_token_id (default: the model's generation config; [] never stops)
        continues with pad_token_id, and generation ends early once every row has. Each block of
        sub_batch_size rows is a sub-batch with its own KV cache; `last_generation` holds the call's stats.
        """
        from sltune.runtime import generate as generation   # imports transformers' cache classes: on first use
        self._whole()

        if self.world > 1:
            raise ValueError("generation runs in one process; call generate outside torch.distributed")
        ids, mask = check_prompt(input_ids, attention_mask, max_new_tokens, self.config, self.lm.config, self.device)
        choose = generation.chooser(do_sample, temperature, top_k, generator)
        eos, pad = generation.special_tokens(self.model, eos_token_id, pad_token_id)
        shape = ("generate", *ids.shape, max_new_tokens)
        mode = self.config.memory_tracking
        track = mode == "always" or (mode == "first" and shape not in self._measured)
        try:
            with step_region(), self.memory.tracking(track), self.params.keeping(self.kept_units):
                tokens, stats = generation.generate(self, ids, mask, max_new_tokens, choose, eos, pad)
        except BaseException:
            self._recover()
            raise
        if track or self.device.type == "cuda":
            self._measured[shape] = self.memory.peak
        stats.peak_device_bytes = self._measured.get(shape)
        self.last_generation = stats
        return tokens

    # -- results -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current parameters (and buffers) under the model's own names: the float32 masters under mixed
        precision, else the model's own. Sharded, the full parameters gathered on every rank (a collective:
        call it on all ranks)."""
        if self.world == 1:
            state = self.model.state_dict()
            masters = {id(u): self.params.master_values(u) for u in self.units if u.host is not None}
            if self.weights is not None:    # no master: the dtype copies, from their files
                masters = {key: self.params.weight_values(u) if masters.get(key) is None else masters[key]
                           for u in self.units if (key := id(u)) in masters}
            views = {id(p): v for unit in self.units if masters.get(id(unit)) is not None
                     for p, v in zip(unit.params, unit.views(masters[id(unit)], unit.offsets))}
            if not views:
                return state
            params = dict(self.model.named_parameters(remove_duplicate=False))
            return {name: views.get(id(params[name]), value) if name in params else value
                    for name, value in state.items()}
        full = self.params.full_state()
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return {name: (full[id(params[name])] if name in params else value.detach().cpu())
                for name, value in self.model.state_dict().items()}

    def expected_io(self, seq_len: int) -> IOCounters:
        """The traffic one train_step on rows of seq_len tokens should move (sltune.runtime.traffic)."""
        return traffic.expected_io(self, seq_len)

    @property
    def param_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def kept_units(self) -> list[ParamUnit]:
        """The units generation keeps on the device for a whole call: weights_on_device of the parameter
        bytes, first fit over tied weights, embedding, head, then the groups in order (residency.kept_share)."""
        order = keep_order(self.tied, self.embed, self.head, [g.unit for g in self.groups])
        return [u for u, keep in zip(order, kept_share([u.nbytes for u in order], self.config.weights_on_device))
                if keep]


def _runnable(config: SpeedLoaderConfig | dict, max_grad_norm: float | None) -> SpeedLoaderConfig:
    """The config as this engine runs it: a SpeedLoaderConfig (or a dict of its fields) of backend speedloader, and a
    positive max_grad_norm or none."""
    if isinstance(config, dict):
        config = SpeedLoaderConfig(**config)
    if not isinstance(config, SpeedLoaderConfig):
        raise TypeError(f"config must be a SpeedLoaderConfig or a dict, got {type(config).__name__}")
    if config.backend != "speedloader":
        raise ValueError(f"backend {config.backend!r}: this engine is SpeedLoader's; train the config with "
                         "`sltune train --config`, which runs the backend it names (sltune.backends)")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 (or None: no clipping), got {max_grad_norm!r}")
    return config


def detached(obj):
    """Layer arguments made with autograd on (the kept prologue) without their graph: the layers' backward
    must not reach into the prologue's."""
    if torch.is_tensor(obj):
        return obj.detach()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):     # a namedtuple
        return type(obj)(*(detached(o) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(detached(o) for o in obj)
    if isinstance(obj, dict):
        return {k: detached(v) for k, v in obj.items()}
    return obj


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None:
                module._buffers[name] = buf.to(device)
