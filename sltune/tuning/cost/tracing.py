"""The meta-device traces behind sltune.tuning.cost.footprint: a sub-batch through the engine's phases on the meta
device, each ATen op's allocation counted as the CPU device's tracker counts it (that module's docstring says what
and why). It imports torch and transformers' model code: sltune.tuning.cost.model_code runs it in a process that has
them already.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from sltune.runtime.memory import CpuAllocationTracker
from sltune.tuning.cost.footprint import Footprint

log = logging.getLogger("sltune.tuning")


def traced(key: str, dtype: str, b: int, s: int, mode: str, resident: bool,
           grads_kept: bool) -> tuple[Footprint, Footprint, int]:
    """The traces with groups of one and of two layers, and the model's layer count."""
    return (*_traced(key, dtype, b, s, mode, resident, grads_kept), len(_meta_model(key, dtype).layers))


@lru_cache(maxsize=256)
def _traced(key: str, dtype: str, b: int, s: int, mode: str, resident: bool,
            grads_kept: bool) -> tuple[Footprint, Footprint]:
    """The traces with groups (and the resident depth) of one and of two layers (one, where the model has one)."""
    lm = _meta_model(key, dtype)
    train = mode == "train"
    lm.model.train(train)
    ids = torch.zeros(b, s, dtype=torch.long, device="meta")
    try:
        with _CpuAttention(), _NoPadding():
            one = _trace(lm, ids, 1, train, resident, grads_kept)
            two = _trace(lm, ids, 2, train, resident, grads_kept) if len(lm.layers) > 1 else one
    except Exception as err:  # noqa: BLE001 - a model whose code cannot run on meta: its buffers still count
        log.warning("the compute of %s cannot be traced on the meta device (%s: %s); its peaks are predicted "
                    "without it", lm.config.model_type, type(err).__name__, err)
        hidden = b * s * lm.config.hidden_size * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        one = two = Footprint(hidden, 0, hidden, hidden, 0, 0, 0, 0, 0, 0, 0)
    return one, two


def _trace(lm, ids: torch.Tensor, k: int, train: bool, resident: bool, grads_kept: bool) -> Footprint:
    """One sub-batch through the engine's phases with groups of k layers: the first k for a body group, the last
    k for the turnaround, the first k before the head for the resident schedule."""
    from sltune.runtime.engine import detached
    from sltune.runtime.family import LayerCall

    layers = len(lm.layers)
    params = list(lm.model.parameters())
    for p in params:        # the engine's gradient buffers: a weight's backward adds into them
        p.grad = torch.empty_like(p) if train and grads_kept else None
    counter = _MetaTracker()
    with counter.tracking(True), torch.set_grad_enabled(train), _SavedBytes(params) as saved_embed:
        hidden, calls = lm.prologue(ids, None, use_cache=False)
    prologue, kept = counter.peak, counter.live - _nbytes(hidden)
    calls = [LayerCall(*detached((c.args, c.kwargs))) for c in calls]
    x = torch.empty_like(hidden).detach()
    forward = _peak(lambda: _no_grad(lm.run_layers, 0, k, x, calls))
    if not train:
        return Footprint(_nbytes(x), kept, prologue, forward, 0, 0, 0, 0, 0, 0, 0)
    gy, labels = torch.empty_like(x), torch.zeros_like(ids)

    def fresh_grads() -> None:      # autograd's own: each sub-batch's backward makes them, its flush drops them
        if not grads_kept:
            for p in params:
                p.grad = None

    counter = _MetaTracker()
    fresh_grads()
    with counter.tracking(True), _SavedBytes(params) as saved:
        y = lm.run_layers(0, k, x.detach().requires_grad_(True), calls)
        held = counter.live
        torch.autograd.backward(y, gy)
        del y
    backward = counter.peak

    def turnaround() -> None:
        y = lm.run_layers(layers - k, layers, x.detach().requires_grad_(True), calls)
        lm.loss(lm.logits(y), labels, int(ids.numel())).backward()

    fresh_grads()
    turn = _peak(turnaround)        # then the embedding's backward through the prologue's own graph
    fresh_grads()
    embed_backward = _peak(lambda: torch.autograd.backward(hidden, gy)) if hidden.requires_grad else 0
    whole = 0
    if resident:
        fresh_grads()

        def everything() -> None:
            h, cs = lm.prologue(ids, None, use_cache=False)
            lm.loss(lm.logits(lm.run_layers(0, k, h, cs)), labels, int(ids.numel())).backward()

        whole = _peak(everything)
    return Footprint(_nbytes(x), kept, prologue, forward, backward, turn, embed_backward, saved[0], saved_embed[0],
                     held, whole)


def _peak(run) -> int:
    tracker = _MetaTracker()
    with tracker.tracking(True):
        run()
    return tracker.peak


def _no_grad(fn, *args: Any) -> Any:
    with torch.no_grad():
        return fn(*args)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@lru_cache(maxsize=4)
def _meta_model(key: str, dtype: str):
    """The model on the meta device in `dtype` (buffers keep theirs, as the engine's model does)."""
    from transformers import AutoModelForCausalLM

    from sltune.models import load_config
    from sltune.runtime.family import CausalLM

    config = load_config(json.loads(key))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return CausalLM(model)


class _SavedBytes:
    """Counts the bytes autograd saves inside the block, each tensor once and parameters not at all, as the
    engine's offload packs them (sltune.runtime.saved)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = {p.untyped_storage()._cdata for p in params}
        self.total = [0]
        self.seen: set[tuple] = set()

    def __enter__(self) -> list[int]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()._cdata
            sig = (storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if storage not in self.params and sig not in self.seen:
                self.seen.add(sig)
                self.total[0] += _nbytes(t)
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self.total

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)


class _NoPadding(TorchDispatchMode):
    """A data-dependent check on a meta tensor answers True, as for a batch without padding or packed sequences."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args and args[0].is_meta:
            if args[0].dtype != torch.bool:
                raise NotImplementedError(f"the model's code reads a {args[0].dtype} value from a tensor; its "
                                          "memory cannot be traced on the meta device")
            return True
        return func(*args, **(kwargs or {}))


class _MetaTracker(CpuAllocationTracker):
    """The CPU tracker's count of fresh ATen outputs, on meta tensors too (no data pointer there: storages are
    told apart by their own identity)."""

    @staticmethod
    def _key(st: torch.UntypedStorage) -> int:
        return st._cdata


class _CpuAttention(TorchFunctionMode):
    """scaled_dot_product_attention as the CPU runs it: the kernel torch picks for these dtypes, heads and mask on
    the CPU (asked on two-token stand-ins), its flash kernel called directly where it is the one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _attention(*args, **kwargs)
        return func(*args, **kwargs)


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    mask = None if attn_mask is None else (attn_mask.dtype, attn_mask.dim())
    if q.is_meta and _cpu_choice(q.dtype, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], mask, dropout_p > 0,
                                 is_causal, enable_gqa) == 1:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


@lru_cache(maxsize=64)
def _cpu_choice(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, v_dim: int, mask: tuple | None,
                dropout: bool, is_causal: bool, enable_gqa: bool) -> int:
    """The backend torch's CPU dispatch picks (sdp::SDPBackend: 0 math, 1 flash) for attention of this kind."""
    q = torch.zeros(1, heads, 2, dim, dtype=dtype)
    k = torch.zeros(1, kv_heads, 2, dim, dtype=dtype)
    v = torch.zeros(1, kv_heads, 2, v_dim, dtype=dtype)
    m = None if mask is None else torch.zeros((1,) * (mask[1] - 2) + (2, 2), dtype=mask[0])
    return int(torch._fused_sdp_choice(q, k, v, m, 0.1 if dropout else 0.0, is_causal, enable_gqa=enable_gqa))
