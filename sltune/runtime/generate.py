"""Sub-batched generation: the SpeedLoader loop inversion applied to decoding.

Every step (the prefill, then one per new token) walks the units once, embedding, groups of live blocks,
head, and runs every sub-batch through each unit while it is loaded:

    for step:                          # prefill, then one token per step
        for unit in embed, groups, head:
            load unit once             # parameters: once per step, however many sub-batches
            for i in sub-batches:      # the next sub-batch's KV block and input load while i computes
                run i through the unit with its own KV cache; write back its new keys and values
        pick the next tokens of all rows (greedy, or sampled with the caller's generator)

weights_on_device keeps a share of the units on the device for the whole call (ParamStore.keeping): they load
at the prefill and every later step finds them live, where the others are copied in at every step.
"canonical" runs the whole pass once per sub-batch instead (every sub-batch loads every unit each step);
"resident" keeps parameters and caches on the device. Where the others keep the caches is kv_cache
(sltune.runtime.kvcache: host memory, attention reading the past where it lives, or the device). All run the
same arithmetic and produce the same tokens.

What a call moves: over T forward steps (the prefill and every decode step), P_u a unit's parameter bytes:

    speedloader  param_load = sum_u P_u + (T-1) * sum_{u streamed} P_u      (kept units load once)
    canonical    param_load = sum_{u kept} P_u + T*N * sum_{u streamed} P_u
    resident     nothing
    device memory: the kept bytes, sum_{u kept} P_u, all call, on top of the live unit

The model's own forward prepares each step, as in training: the prologue runs the library's base model with
the layers replaced by recorders, given what transformers' generate would pass (the full-length attention
mask, position ids from its cumulative sum so left padding works, a Cache, use_cache=True); the Cache is a
SlotCache per sub-batch, so the recorded per-layer arguments point at it and its update() writes into the
block bound for the group being run. As in generate, a mask without any padding is passed as None, so the
library picks the same mask and attention kernels and the tokens match transformers' exactly.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from sltune.config import SpeedLoaderConfig
from sltune.runtime.activations import DeviceActivations, HostActivations
from sltune.runtime.family import CausalLM, LayerCall
from sltune.runtime.kvcache import KVShape, KVStore, Writer
from sltune.runtime.params import ParamStore, ParamUnit
from sltune.runtime.regions import region
from sltune.runtime.counters import IOCounters
from sltune.runtime.transfer import Copier

Chooser = Callable[[torch.Tensor], torch.Tensor]


class Runtime(Protocol):
    """What generation uses of the engine (engine.SpeedLoaderEngine), named here so that the engine imports
    this module and not the other way round."""

    config: SpeedLoaderConfig
    lm: CausalLM
    dtype: torch.dtype
    io: IOCounters
    copier: Copier
    params: ParamStore
    acts: HostActivations | DeviceActivations
    kv: KVStore
    groups: list          # engine._Group: first, last, unit
    embed: ParamUnit
    head: ParamUnit
    tied: ParamUnit


def layer_windows(config) -> list[int | None]:
    """Per layer: its sliding window, or None for full attention, as transformers' DynamicCache decides."""
    windows = []
    for j, layer in enumerate(DynamicCache(config=config.get_text_config(decoder=True)).layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            windows.append(layer.sliding_window)
        elif type(layer) is DynamicLayer:
            windows.append(None)
        else:
            raise ValueError(f"layer {j} needs a {type(layer).__name__} cache; sltune generation supports full and "
                             "sliding-window attention layers only")
    return windows


def kv_dims(config) -> tuple[int, int]:
    """(key/value heads, head dim) of the attention layers, from the config's standard fields."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


class _SlotLayer(CacheLayerMixin):
    """One model layer's view of a SlotCache; sizes as DynamicLayer / DynamicSlidingWindowLayer report them."""

    is_compileable = False

    def __init__(self, cache: "SlotCache", index: int, sliding_window: int | None):
        super().__init__()
        self.cache = cache
        self.index = index
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to initialise: the storage is the bound block."""

    def first_visible(self, past: int) -> int:
        """The first position this layer attends to: a sliding layer keeps the last window-1 past positions."""
        return 0 if self.sliding_window is None else max(past - self.sliding_window + 1, 0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.write(self.index, self.first_visible(self.cache.past), key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        past = self.cache.past
        start = self.first_visible(past)
        return past - start + query_length, start

    def get_seq_length(self) -> int:
        return self.cache.past

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window


class SlotCache(Cache):
    """The Cache one sub-batch passes to the model; its layers write into the block bound for the current group."""

    def __init__(self, windows: list[int | None]):
        super().__init__(layers=[_SlotLayer(self, j, w) for j, w in enumerate(windows)])
        self.past = 0                       # positions already cached (equal for every layer and sub-batch)
        self._block: torch.Tensor | None = None
        self._first = 0
        self._write: Writer | None = None

    def bind(self, block: torch.Tensor, first_layer: int, write: Writer) -> None:
        """Point layers first_layer.. at this block [T, 2, k, b, heads, head_dim] for the next run_layers;
        `write` puts new positions into it (a counted copy when the block is in host memory)."""
        self._block = block
        self._first = first_layer
        self._write = write

    def unbind(self) -> None:
        self._block = None

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor):
        """Store the new positions of one layer; return its keys and values from `start` on."""
        if self._block is None:
            raise RuntimeError(f"layer {layer} wrote to a KV cache with no block bound; bind() before run_layers")
        slot = layer - self._first
        end = self.past + keys.shape[-2]
        b, heads, _, dim = keys.shape
        if not 0 <= slot < self._block.shape[2] or end > self._block.shape[0] \
                or tuple(self._block.shape[3:]) != (b, heads, dim):
            raise RuntimeError(f"layer {layer}: keys {tuple(keys.shape)} at positions {self.past}:{end} do not fit "
                               f"the bound block {tuple(self._block.shape)} (first layer {self._first})")
        new = self._block[self.past:end]
        self._write(new[:, 0, slot], keys.permute(2, 0, 1, 3))
        self._write(new[:, 1, slot], values.permute(2, 0, 1, 3))
        seen = self._block[start:end]
        return seen[:, 0, slot].permute(1, 2, 0, 3), seen[:, 1, slot].permute(1, 2, 0, 3)

    def first_visible(self, first_layer: int, last_layer: int) -> int:
        """The earliest position any of these layers attends to at the next step."""
        return min(self.layers[j].first_visible(self.past) for j in range(first_layer, last_layer))


@dataclass
class GenerationStats:
    """What one generate call did: tokens, time, and bytes moved, in total and per forward step."""

    new_tokens: int                                       # generated tokens over all rows
    seconds: float
    io: IOCounters
    step_io: list[IOCounters] = field(default_factory=list)   # [0] is the prefill, then one per decode step
    peak_device_bytes: int | None = None


@dataclass
class _Rows:
    """One sub-batch in one step: its rows' inputs and the layer arguments its prologue recorded."""

    index: int
    ids: torch.Tensor
    mask: torch.Tensor | None
    positions: torch.Tensor
    cache: SlotCache
    calls: list[LayerCall] = field(default_factory=list)


def special_tokens(model: nn.Module, eos_token_id, pad_token_id) -> tuple[list[int], int | None]:
    """eos and pad ids as transformers' generate resolves them: the generation config's by default, pad
    falling back to the first eos. An eos outside the vocabulary can never be produced: like transformers,
    generate anyway (to max_new_tokens), but say so."""
    gen_cfg = getattr(model, "generation_config", None)
    eos = eos_token_id if eos_token_id is not None else getattr(gen_cfg, "eos_token_id", None)
    eos = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    pad = pad_token_id if pad_token_id is not None else getattr(gen_cfg, "pad_token_id", None)
    vocab = model.config.vocab_size
    if pad is not None and not 0 <= pad < vocab:
        raise ValueError(f"pad_token_id {pad} is not a token id in [0, {vocab})")
    for e in eos:
        if not 0 <= e < vocab:
            warnings.warn(f"eos_token_id {e} is not a token id in [0, {vocab}): no row can stop at it",
                          UserWarning, stacklevel=3)
    if pad is None and eos:
        pad = eos[0]
    return eos, pad


def chooser(do_sample: bool, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> Chooser:
    """Next tokens from float32 logits [rows, vocab]: argmax, or a draw after temperature and top-k (the order
    transformers applies them); draws come from `generator` so a seed reproduces them."""
    if not do_sample:
        return lambda logits: logits.argmax(dim=-1)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 when do_sample=True, got {temperature}; use do_sample=False "
                         "for greedy decoding")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")

    def sample(logits: torch.Tensor) -> torch.Tensor:
        scores = logits / temperature
        if top_k is not None and top_k < scores.shape[-1]:
            kth = torch.topk(scores, top_k).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        where = generator.device if generator is not None else probs.device
        drawn = torch.multinomial(probs.to(where), 1, generator=generator).squeeze(1)
        return drawn.to(logits.device)

    return sample


def generate(engine: Runtime, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
             choose: Chooser, eos: list[int], pad: int | None) -> tuple[torch.Tensor, GenerationStats]:
    """Prompt ids [b*N, s] (left-padded, mask 1 on real tokens) -> [b*N, s + new]; stops early only when every
    row has produced one of `eos` (later tokens of a finished row are `pad`), like transformers."""
    cfg, lm = engine.config, engine.lm
    b, n = cfg.sub_batch_size, cfg.num_sub_batches
    rows, s = ids.shape
    capacity = s + max_new_tokens
    start = time.perf_counter()
    before = engine.io.copy()

    # as transformers' generate: positions count real tokens (padding at 0), new tokens continue from the last;
    # a mask without padding is dropped, new tokens are attended to by every row
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, max_new_tokens + 1, device=ids.device)], 1)
    full_mask = None if bool(mask.all()) else torch.cat([mask, mask.new_ones(rows, max_new_tokens)], 1)

    windows = layer_windows(lm.config)
    kv_heads, head_dim = kv_dims(lm.config)
    shape = KVShape(tuple(g.last - g.first for g in engine.groups), n, b, kv_heads, head_dim, capacity, engine.dtype)
    caches = [SlotCache(windows) for _ in range(n)]
    engine.kv.prepare(shape)
    tokens = ids
    step_in = ids
    unfinished = torch.ones(rows, dtype=torch.bool, device=ids.device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=ids.device)
    step_io: list[IOCounters] = []
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                step_start = engine.io.copy()
                past, q = caches[0].past, step_in.shape[1]
                subs = [_Rows(i, step_in[i * b:(i + 1) * b],
                              None if full_mask is None else full_mask[i * b:(i + 1) * b, :past + q],
                              positions[i * b:(i + 1) * b, past:past + q], caches[i]) for i in range(n)]
                if cfg.schedule == "canonical":
                    logits = torch.cat([_step(engine, [sb]) for sb in subs])
                else:
                    logits = _step(engine, subs)
                for c in caches:
                    c.past += q
                with region("compute", "sample"):
                    nxt = choose(logits)
                    if eos:
                        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
                        unfinished &= ~torch.isin(nxt, eos_t)
                    tokens = torch.cat([tokens, nxt[:, None]], dim=1)
                step_io.append(engine.io - step_start)
                if eos and not bool(unfinished.any()):
                    break
                step_in = nxt[:, None]
        engine.copier.synchronize()
    finally:
        engine.kv.close_all()
        for c in caches:
            c.unbind()
    stats = GenerationStats(new_tokens=rows * (tokens.shape[1] - s), seconds=time.perf_counter() - start,
                            io=engine.io - before, step_io=step_io)
    return tokens, stats


def _step(engine: Runtime, subs: list[_Rows]) -> torch.Tensor:
    """One forward step of these sub-batches through every unit, each unit loaded once: last-position logits."""
    store, acts, lm = engine.params, engine.acts, engine.lm
    b, q = subs[0].ids.shape
    past = subs[0].cache.past
    edges = len(engine.groups) + 1
    acts.prepare(edges, len(subs), (b, q, lm.config.hidden_size), engine.dtype)
    units = [engine.embed, *(g.unit for g in engine.groups), engine.head]
    detail = "prefill" if past == 0 else "decode"
    logits: list[torch.Tensor] = []
    store.activate(engine.tied)
    # A copy ahead overlaps compute only where copies run beside it (CUDA streams). Where they do not, the
    # next unit copied before this one computes only pushes this one's weights out of the cache that all N
    # sub-batches read them from (k=2 of llama-small: two 25 MB groups against a 32 MB L3).
    ahead = engine.copier.cuda
    for u, unit in enumerate(units):
        if unit is engine.embed or unit is engine.head:
            store.activate(unit)        # a group is activated by _run_group, layer by layer where it can
        if u + 1 < len(units):
            if ahead:
                store.prefetch(units[u + 1])
            else:               # param_offload disk: its file read ahead, the device copy left to its activation
                store.read_ahead(units[u + 1])
        if unit is engine.embed:
            for j, sb in enumerate(subs):
                with region("compute", f"embed_{detail}"):
                    hidden, sb.calls = lm.prologue(sb.ids, sb.mask, cache=sb.cache,
                                                   position_ids=sb.positions, use_cache=True)
                acts.put(0, j, hidden)
        elif unit is engine.head:
            for j, _ in enumerate(subs):
                x = acts.fetch(edges - 1, j).wait()
                with region("compute", f"head_{detail}"):
                    logits.append(lm.logits(x[:, -1:])[:, -1].to(torch.float32))
        else:
            _run_group(engine, u - 1, subs, past, q, detail)
        store.release(unit)
    store.release(engine.tied)
    return torch.cat(logits)


def _run_group(engine: Runtime, g: int, subs: list[_Rows], past: int, q: int, detail: str) -> None:
    """Every sub-batch through group g, inputs and outputs at its edges in engine.acts.

    Sub-batch by sub-batch, the next one's input and KV block loading while this one computes. A decode step
    whose caches stay in place (nothing staged) goes layer by layer instead, every sub-batch through one
    layer before the next: a layer's weights are read by all N sub-batches while they are still in the
    cache, where sub-batch order reads k layers' weights N times each (k=2 ran slower than k=1 at N>1, the
    resident schedule too). With synchronous copies each layer is also copied just before it runs. The held
    state is N sub-batches' one-position hidden states: b*N*hidden."""
    acts, kv, lm, store = engine.acts, engine.kv, engine.lm, engine.params
    group = engine.groups[g]
    start = subs[0].cache.first_visible(group.first, group.last)
    write = kv.writer()
    if q == 1 and kv.in_place and group.last - group.first > 1:
        parts = store.loads_in_parts
        if not parts:
            store.activate(group.unit)
        xs = [acts.fetch(g, j).wait() for j in range(len(subs))]
        blocks = [kv.load(g, sb.index, start, past).wait() for sb in subs]
        for i, layer in enumerate(range(group.first, group.last)):
            if parts:
                store.load_part(group.unit, i)
            for j, sb in enumerate(subs):
                sb.cache.bind(blocks[j], group.first, write)
                with region("compute", f"layers_{detail}"):
                    xs[j] = lm.run_layers(layer, layer + 1, xs[j], sb.calls)
                sb.cache.unbind()
        for j, sb in enumerate(subs):
            kv.store(g, sb.index, blocks[j], past, q)
            acts.put(g + 1, j, xs[j])
        return

    store.activate(group.unit)

    def load(j: int):
        return acts.fetch(g, j), kv.load(g, subs[j].index, start, past)

    nxt = load(0)
    for j, sb in enumerate(subs):
        x, block = nxt
        if j + 1 < len(subs):
            nxt = load(j + 1)
        block = block.wait()
        sb.cache.bind(block, group.first, write)
        with region("compute", f"layers_{detail}"):
            y = lm.run_layers(group.first, group.last, x.wait(), sb.calls)
        sb.cache.unbind()
        kv.store(g, sb.index, block, past, q)
        acts.put(g + 1, j, y)
