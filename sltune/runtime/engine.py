"""SpeedLoaderEngine: trains a transformers causal LM whose weights live in host memory.

One training step, per the SpeedLoader method (../shared/design/speedloader.md), with G groups of
num_live_blocks layers plus the embedding and the head as units:

    forward    for each unit: load it once, run all N sub-batches through it, offload each output
    head       per sub-batch: logits, loss and dL/dh in one pass; head gradients stay on the device
    backward   for each unit in reverse: load it once, per sub-batch recompute from the stored input and
               backpropagate; gradients accumulate on the device and are offloaded once
    optimizer  the user's optimizer steps the host parameters

The "canonical" schedule runs the same pass once per micro-batch (every micro-batch loads every unit,
gradients offloaded and added on the host each time: ZeRO-Offload's traffic), keeping activations on the
device. "resident" keeps everything on the device: the no-I/O bound.

Bytes per step, per channel (P_u: parameter bytes of unit u, G_u: its trainable gradient bytes,
A = (G+1)*b*s*hidden*itemsize: one sub-batch's activations at the G+1 group edges):

    speedloader  param_load = sum_u 2*P_u - P_head - P_tied   (head and tied weights load once)
                 grad_offload = sum_u G_u
                 act_offload = 2*N*A (activations forward, their gradients backward)
                 act_load = 3*N*A - N*a, a = A/(G+1): each edge's activation is loaded twice and its
                            gradient once, except the head's input, whose gradient is made on the device
    canonical    N times speedloader's param_load and grad_offload at N=1; no activation traffic
    resident     nothing

Sharded over W ranks (torch.distributed initialised), P_u above is this rank's shard of unit u, and the
collectives see whole (padded) units: allgather = the same count of loads times the unit's bytes,
reduce_scatter = the unit's bytes once per gradient offload. Each rank runs its own b*N rows.

`expected_io()` computes these; the tests hold the counters to them.

`generate()` runs the same inversion for decoding (sltune.runtime.generate): per step each unit loads once
and every sub-batch passes through it with its own KV cache, in host or device memory as kv_cache says
(sltune.runtime.kvcache). generate.py does not import this module: it names what it uses as generate.Runtime.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from sltune.config import SpeedLoaderConfig
from sltune.runtime.activations import DeviceActivations, HostActivations
from sltune.runtime.family import CausalLM, LayerCall, unique_params
from sltune.runtime.kvcache import kv_store
from sltune.runtime.memory import DeviceMemory, monitor_for
from sltune.runtime.params import BufferPool, ParamStore, ParamUnit
from sltune.runtime.regions import region, step_region
from sltune.runtime.sharding import ShardedParamStore
from sltune.runtime.transfer import Copier, IOCounters

if TYPE_CHECKING:
    from sltune.runtime.generate import GenerationStats

IGNORE_INDEX = -100
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class StepResult:
    loss: float
    tokens: int
    seconds: float
    io: IOCounters
    peak_device_bytes: int | None = None   # measured on this step, or on the first step of this shape


@dataclass
class _SubBatch:
    ids: torch.Tensor
    labels: torch.Tensor | None
    mask: torch.Tensor | None
    calls: list[LayerCall] = field(default_factory=list)


@dataclass
class _Group:
    first: int
    last: int
    unit: ParamUnit


class SpeedLoaderEngine:
    """Wraps a transformers causal LM; the model keeps its code, its parameters and their names."""

    def __init__(self, model: nn.Module, config: SpeedLoaderConfig | dict,
                 optimizer: OptimizerFactory | None = None):
        if isinstance(config, dict):
            config = SpeedLoaderConfig(**config)
        if not isinstance(config, SpeedLoaderConfig):
            raise TypeError(f"config must be a SpeedLoaderConfig or a dict, got {type(config).__name__}")
        self.config = config
        self.device = _check_device(config.device)
        self.dtype = getattr(torch, config.dtype)
        _check_dtype(self.device, self.dtype)
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
        model.to(dtype=self.dtype)
        if self.device.type != "cpu":
            _move_buffers(model, self.device)

        self.io = IOCounters()
        self.memory: DeviceMemory = monitor_for(self.device, config.device_memory_limit)
        self.copier = Copier(self.device, self.io)
        self.pool = BufferPool(self.device, self.memory)
        self._build_units()
        resident = config.schedule == "resident"
        if self.world > 1:
            self.params = ShardedParamStore(self.units, self.dtype, self.copier, self.pool)
        else:
            self.params = ParamStore(self.units, self.dtype, self.copier, self.pool, resident=resident)
        self.acts = HostActivations(self.copier, self.memory) if config.schedule == "speedloader" \
            else DeviceActivations()
        self.kv = kv_store(config.schedule, config.kv_cache, self.copier, self.pool, self.memory)
        self.last_generation: "GenerationStats | None" = None
        self.optimizer: torch.optim.Optimizer | None = None
        if optimizer is not None:
            # sharded: this rank's flat shard of each unit (same update for element-wise optimizers)
            trainable = self.params.shard_params if self.world > 1 else \
                [p for p in unique_params(model.parameters()) if p.requires_grad]
            opt = optimizer(trainable)
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
            _warn_vanishing_eps(opt, self.dtype)
            self.optimizer = opt
        self._measured: dict[tuple, int] = {}

    # -- units -------------------------------------------------------------------------------------
    def _build_units(self) -> None:
        prologue, layers, head = self.lm.param_groups()
        tied_ids = {id(p) for p in prologue} & {id(p) for p in head}
        k = self.config.num_live_blocks
        self.embed = ParamUnit("embed", [p for p in prologue if id(p) not in tied_ids])
        self.groups = [
            _Group(a, min(a + k, len(layers)),
                   ParamUnit(f"layers[{a}:{min(a + k, len(layers))}]", [p for ps in layers[a:a + k] for p in ps]))
            for a in range(0, len(layers), k)
        ]
        self.head = ParamUnit("head", [p for p in head if id(p) not in tied_ids])
        self.tied = ParamUnit("tied", [p for p in prologue if id(p) in tied_ids])
        self.units = [self.embed, *(g.unit for g in self.groups), self.head, self.tied]

    # -- training ----------------------------------------------------------------------------------
    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None) -> StepResult:
        """One optimizer step on b*N rows; the loss is the model's mean token loss over all of them."""
        if self.optimizer is None:
            raise ValueError("this engine was built with optimizer=None and can only generate; "
                             "pass optimizer=lambda params: torch.optim.AdamW(params, lr=...) to train")
        ids, labels, mask = self._check_batch(input_ids, labels, attention_mask)
        start = time.perf_counter()
        before = self.io.copy()
        shape = tuple(ids.shape)
        mode = self.config.memory_tracking
        track = mode == "always" or (mode == "first" and shape not in self._measured)
        try:
            with step_region(), self.memory.tracking(track):
                loss = self._train(ids, labels, mask)
        except BaseException:
            self._recover()
            raise
        if track or self.device.type == "cuda":
            self._measured[shape] = self.memory.peak
        return StepResult(loss=loss, tokens=ids.numel(), seconds=time.perf_counter() - start,
                          io=self.io - before, peak_device_bytes=self._measured.get(shape))

    def _train(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None) -> float:
        b, n = self.config.sub_batch_size, self.config.num_sub_batches
        num_items = (labels[:, 1:] != IGNORE_INDEX).sum()
        if self.world > 1:     # the loss is the mean over the union of every rank's batch
            dist.all_reduce(num_items)
        num_items = int(num_items)
        subs = [_SubBatch(ids[i * b:(i + 1) * b], labels[i * b:(i + 1) * b],
                          None if mask is None else mask[i * b:(i + 1) * b]) for i in range(n)]
        self._rng = _RngStash(self.device, enabled=self.model.training)
        if self.config.schedule == "canonical":
            loss = sum(self._pass([sb], num_items, accumulate=j > 0) for j, sb in enumerate(subs))
        else:
            self.params.zero_resident_grads()
            loss = self._pass(subs, num_items, accumulate=False)
        self.copier.synchronize()
        host_side = self.config.schedule != "resident"
        with self.memory.paused() if host_side else contextlib.nullcontext(), \
                region("cpu" if host_side else "compute", "optimizer"):
            self.optimizer.step()
        if self.world > 1:
            dist.all_reduce(loss)
        return float(loss)

    def _pass(self, subs: list[_SubBatch], num_items: int, accumulate: bool) -> torch.Tensor:
        """Forward, head and backward of every unit over these sub-batches; gradients to the host."""
        store, acts, lm = self.params, self.acts, self.lm
        n, last_edge = len(subs), len(self.groups)
        b, s = subs[0].ids.shape
        acts.prepare(last_edge + 1, n, (b, s, self.lm.config.hidden_size), self.dtype)
        trains, phases = self._plan()
        losses = []
        store.activate(self.tied)
        store.begin_grads(self.tied)
        for idx, (kind, unit, group) in enumerate(phases):
            store.activate(unit)
            if idx + 1 < len(phases):
                store.prefetch(phases[idx + 1][1])
            backward = kind in ("head", "bwd", "embed_bwd")
            if backward:
                store.begin_grads(unit)
            if kind == "embed_fwd":
                for i, sb in enumerate(subs):
                    with torch.no_grad(), self._rng.save(("embed", i)), region("compute", kind):
                        hidden, sb.calls = lm.prologue(sb.ids, sb.mask, use_cache=False)
                    acts.put(0, i, hidden)
            elif kind == "fwd":
                edge = self.groups.index(group)
                for i, (x, _) in self._each(edge, None, n):
                    with torch.no_grad(), self._rng.save((edge, i)), region("compute", kind):
                        y = lm.run_layers(group.first, group.last, x.wait(), subs[i].calls)
                    acts.put(edge + 1, i, y)
            elif kind == "head":
                for i, (x, _) in self._each(last_edge, None, n):
                    x = x.wait().detach().requires_grad_(trains[last_edge])
                    with torch.enable_grad(), region("compute", kind):
                        loss = lm.loss(lm.logits(x), subs[i].labels, num_items)
                        if loss.requires_grad:
                            loss.backward()
                    if x.grad is not None:
                        acts.put(last_edge, i, x.grad)
                    losses.append(loss.detach())
            elif kind == "bwd":
                edge = self.groups.index(group)
                for i, (x, gy) in self._each(edge, edge + 1, n):
                    x = x.wait().detach().requires_grad_(trains[edge])
                    gy = gy.wait()
                    with torch.enable_grad(), self._rng.replay((edge, i)), region("compute", kind):
                        y = lm.run_layers(group.first, group.last, x, subs[i].calls)
                        torch.autograd.backward(y, gy)
                    if x.grad is not None:
                        acts.put(edge, i, x.grad)
                    acts.drop(edge + 1, i)
            else:  # embed_bwd
                for i, (_, gy) in self._each(None, 0, n):
                    gy = gy.wait()
                    with torch.enable_grad(), self._rng.replay(("embed", i)), region("compute", kind):
                        hidden, _ = lm.prologue(subs[i].ids, subs[i].mask, use_cache=False)
                        torch.autograd.backward(hidden, gy)
                    acts.drop(0, i)
            if backward:
                store.offload_grads(unit, accumulate)
            store.release(unit)
        store.offload_grads(self.tied, accumulate)
        store.release(self.tied)
        return torch.stack(losses).sum()

    def _plan(self) -> tuple[list[bool], list[tuple]]:
        """The phases of a pass, and for each group edge whether a gradient must flow back through it.

        Backward through a unit is needed while a trainable parameter sits in it or before it: a frozen
        prefix of the model (fine-tuning the top layers) gets no backward, no loads and no copies for it.
        Sharded, `has_grads` is the same on every rank, so every rank runs the same collectives."""
        trains = [self.embed.has_grads or self.tied.has_grads]
        for g in self.groups:
            trains.append(trains[-1] or g.unit.has_grads)
        phases = ([("embed_fwd", self.embed, None)] + [("fwd", g.unit, g) for g in self.groups]
                  + [("head", self.head, None)] + [("bwd", g.unit, g) for g in reversed(self.groups)]
                  + [("embed_bwd", self.embed, None)])
        phases = [ph for ph in phases if ph[0] not in ("bwd", "embed_bwd")
                  or trains[0 if ph[2] is None else self.groups.index(ph[2]) + 1]]
        return trains, phases

    def _each(self, edge: int | None, grad_edge: int | None, n: int) -> Iterator:
        """Sub-batch indices with their inputs fetched one ahead (the next copy overlaps this compute)."""
        def fetch(i):
            return (None if edge is None else self.acts.fetch(edge, i),
                    None if grad_edge is None else self.acts.fetch(grad_edge, i))
        nxt = fetch(0)
        for i in range(n):
            cur = nxt
            if i + 1 < n:
                nxt = fetch(i + 1)
            yield i, cur

    def _recover(self) -> None:
        """After a failed step (out of memory, interrupt): parameters back on the host copy, unchanged."""
        self.params.reset()
        self.acts.clear()
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

        if self.world > 1:
            raise ValueError("generation runs in one process; call generate outside torch.distributed")
        ids, mask = self._check_prompt(input_ids, attention_mask, max_new_tokens)
        choose = generation.chooser(do_sample, temperature, top_k, generator)
        eos, pad = generation.special_tokens(self.model, eos_token_id, pad_token_id)
        shape = ("generate", *ids.shape, max_new_tokens)
        mode = self.config.memory_tracking
        track = mode == "always" or (mode == "first" and shape not in self._measured)
        try:
            with step_region(), self.memory.tracking(track):
                tokens, stats = generation.generate(self, ids, mask, max_new_tokens, choose, eos, pad)
        except BaseException:
            self._recover()
            raise
        if track or self.device.type == "cuda":
            self._measured[shape] = self.memory.peak
        stats.peak_device_bytes = self._measured.get(shape)
        self.last_generation = stats
        return tokens

    # -- inputs ------------------------------------------------------------------------------------
    def _check_ids(self, input_ids, what: str, extra_tokens: int = 0) -> None:
        """b*N rows of token ids that fit the model: the checks training and generation share."""
        cfg = self.config
        rows = cfg.sub_batch_size * cfg.num_sub_batches
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.is_floating_point():
            got = (f"a {input_ids.dim()}-D {input_ids.dtype} tensor of shape {tuple(input_ids.shape)}"
                   if torch.is_tensor(input_ids) else type(input_ids).__name__)
            raise ValueError(f"input_ids must be a 2-D LongTensor [rows, {what}], got {got}")
        if input_ids.shape[0] != rows:
            raise ValueError(
                f"input_ids has {input_ids.shape[0]} rows but sub_batch_size*num_sub_batches = "
                f"{cfg.sub_batch_size}*{cfg.num_sub_batches} = {rows}; pass {rows} rows or change num_sub_batches"
            )
        total = input_ids.shape[1] + extra_tokens
        max_pos = getattr(self.lm.config, "max_position_embeddings", None)
        if max_pos is not None and total > max_pos:
            tokens = "prompt_len + max_new_tokens" if extra_tokens else "seq_len"
            raise ValueError(f"{tokens} = {total} exceeds the model's max_position_embeddings {max_pos}")
        vocab = self.lm.config.vocab_size
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(f"input_ids must be token ids in [0, {vocab}); got values in "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")

    def _check_batch(self, input_ids, labels, attention_mask):
        self._check_ids(input_ids, "seq_len")
        if input_ids.shape[1] < 2:
            raise ValueError("input_ids needs at least 2 tokens per row to have a next-token loss")
        if labels is None:
            labels = input_ids
        elif not torch.is_tensor(labels) or labels.shape != input_ids.shape:
            got = tuple(labels.shape) if torch.is_tensor(labels) else type(labels).__name__
            raise ValueError(f"labels {got} must have input_ids' shape {tuple(input_ids.shape)}")
        vocab = self.lm.config.vocab_size
        used = labels[:, 1:][labels[:, 1:] != IGNORE_INDEX]
        if used.numel() == 0:
            raise ValueError(f"labels: every next-token label is {IGNORE_INDEX} (ignored), so there is nothing to "
                             "train on; pass labels with some real token ids")
        if int(used.min()) < 0 or int(used.max()) >= vocab:
            raise ValueError(f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX} (ignored); got values in "
                             f"[{int(used.min())}, {int(used.max())}]")
        if attention_mask is not None:
            if not torch.is_tensor(attention_mask) or attention_mask.shape != input_ids.shape:
                got = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
                raise ValueError(f"attention_mask {got} must have input_ids' shape {tuple(input_ids.shape)}")
            if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
        dev = self.device
        return (input_ids.to(dev, torch.long), labels.to(dev, torch.long),
                None if attention_mask is None else attention_mask.to(dev))

    def _check_prompt(self, input_ids, attention_mask, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt ids and a 0/1 mask (all ones if None) on the device, left padding checked."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self._check_ids(input_ids, "prompt_len", extra_tokens=max_new_tokens)
        if input_ids.shape[1] < 1:
            raise ValueError("input_ids needs at least 1 prompt token per row")
        if attention_mask is None:
            mask = torch.ones(input_ids.shape, dtype=torch.long)
        else:
            if not torch.is_tensor(attention_mask) or attention_mask.shape != input_ids.shape:
                got = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
                raise ValueError(f"attention_mask {got} must be a tensor shaped like input_ids "
                                 f"{tuple(input_ids.shape)}")
            mask = attention_mask.long()
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
            if not bool(mask[:, -1].all()):
                raise ValueError("attention_mask: every row's last prompt position must be a token; pad prompts on "
                                 "the left (tokenizer.padding_side = 'left')")
            if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
                raise ValueError("attention_mask has padding after a token; pad prompts on the left only "
                                 "(tokenizer.padding_side = 'left')")
        return input_ids.to(self.device, torch.long), mask.to(self.device)

    # -- results -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current parameters (and buffers) under the model's own names; sharded, the full parameters
        gathered on every rank (a collective: call it on all ranks)."""
        if self.world == 1:
            return self.model.state_dict()
        full = self.params.full_state()
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return {name: (full[id(params[name])] if name in params else value.detach().cpu())
                for name, value in self.model.state_dict().items()}

    def expected_io(self, seq_len: int) -> IOCounters:
        """The traffic one train_step should move, from the formulas in this module's docstring, walking
        the same phases a step runs (a frozen prefix skips its backward)."""
        cfg = self.config
        n, b = cfg.num_sub_batches, cfg.sub_batch_size
        if cfg.schedule == "resident":
            return IOCounters()
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        trains, phases = self._plan()
        loaded = [unit for _, unit, _ in phases] + [self.tied]                 # tied: once per pass
        backward = [unit for kind, unit, _ in phases if kind != "embed_fwd" and kind != "fwd"] + [self.tied]
        loads = sum(u.nbytes for u in loaded)
        grads = sum(u.grad_nbytes for u in backward)
        gathered = scattered = 0
        if self.world > 1:   # sharded: the loads above are this rank's shards; collectives see whole units
            gathered = sum(u.padded * itemsize for u in loaded if u.host is not None)
            scattered = sum(u.padded * itemsize for u in backward if u.host is not None and u.has_grads)
        if cfg.schedule == "canonical":
            return IOCounters(param_load_bytes=n * loads, grad_offload_bytes=n * grads,
                              allgather_bytes=n * gathered, reduce_scatter_bytes=n * scattered)
        # boundary activations per sub-batch, in edges of b*s*hidden values: forward puts every edge and
        # loads every group's and the head's input; backward loads each group's input and output gradient,
        # puts its input gradient where one is needed, and the embedding loads its output gradient
        edges_out = len(self.groups) + 1 + int(trains[len(self.groups)])
        edges_in = len(self.groups) + 1
        for kind, _, group in phases:
            if kind == "bwd":
                edge = self.groups.index(group)
                edges_in += 2
                edges_out += int(trains[edge])
            elif kind == "embed_bwd":
                edges_in += 1
        edge_bytes = b * seq_len * self.lm.config.hidden_size * itemsize
        return IOCounters(param_load_bytes=loads, grad_offload_bytes=grads, allgather_bytes=gathered,
                          reduce_scatter_bytes=scattered, act_offload_bytes=n * edges_out * edge_bytes,
                          act_load_bytes=n * edges_in * edge_bytes)

    @property
    def param_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)


class _RngStash:
    """Dropout must draw the same numbers when a group is recomputed: keep the RNG state per
    (unit, sub-batch) at the forward and replay it in backward, as torch.utils.checkpoint does."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.device = device
        self._states: dict = {}

    @contextlib.contextmanager
    def save(self, key) -> Iterator[None]:
        if self.enabled:
            self._states[key] = (torch.get_rng_state(),
                                 torch.cuda.get_rng_state(self.device) if self.cuda else None)
        yield

    @contextlib.contextmanager
    def replay(self, key) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        cpu, cuda = self._states.pop(key)
        with torch.random.fork_rng(devices=[self.device] if self.cuda else []):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
            yield


def _warn_vanishing_eps(opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Parameters and optimizer state stay in the engine's dtype (no float32 master copy), so an eps that
    rounds to 0 there turns zero gradients into 0/0 = NaN, as it would for model.half() in plain PyTorch."""
    for group in opt.param_groups:
        eps = group.get("eps")
        if isinstance(eps, float) and eps > 0 and torch.tensor(eps, dtype=dtype).item() == 0.0:
            warnings.warn(f"optimizer eps={eps:g} is 0 in {str(dtype).removeprefix('torch.')}: zero gradients will "
                          "give NaN updates; use eps >= 1e-4 or dtype='bfloat16'", UserWarning, stacklevel=3)
            return


def _check_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} is not available on this machine (no CUDA); use device='cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} does not exist; this machine has {torch.cuda.device_count()} GPUs")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"device {name!r} is not supported; use 'cpu' or 'cuda[:index]'")
    return device


def _check_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Fail early, with the alternatives, if the device cannot compute in this dtype."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{device} cannot compute in bfloat16; use dtype='float16' or 'float32'")
    try:
        a = torch.ones(4, 4, dtype=dtype, device=device)
        torch.softmax(a @ a, dim=-1)
    except RuntimeError as err:
        raise ValueError(f"{device} cannot compute in {dtype} ({err}); use dtype='float32'") from None


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None:
                module._buffers[name] = buf.to(device)
