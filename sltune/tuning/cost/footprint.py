"""What one sub-batch's compute allocates on the device beyond the engine's own buffers, traced on the meta device.

The engine's buffers (parameters, gradients, boundary activations, KV blocks) have exact byte formulas
(sltune.tuning.cost.prior). What a layer allocates while it computes is its family's code's business: its
intermediates, what autograd saves, the gradient a weight's backward makes before it is added into the unit's
buffer. So the prior runs that code, the engine's way (the prologue recording every layer's arguments, a group
of layers, the head and loss, each forward and backward), on the meta device, where tensors have shapes and no
storage, and counts what every ATen op allocates exactly as the CPU device's tracker counts it
(sltune.runtime.memory): fresh outputs, live until freed. A trace costs milliseconds and no memory whatever the
model's size. The tracing is sltune.tuning.cost.tracing's, run where sltune.profiling.forks.call says (this process
when it has torch, else a child of the trials' fork server): what this module keeps is the arithmetic over traces.

Two things run differently on meta and are set right: the data-dependent checks the prologue makes (is the
batch packed? is every position real?) answer as for a batch without padding, which is what trials and the
tuner's configs run; and scaled_dot_product_attention, which on meta always takes the math path (its
b*heads*s*s scores held for the backward), takes the kernel the CPU would choose (its flash kernel keeps a
logsumexp of b*heads*s). On CUDA the same CPU choice stands in: no GPU has checked it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from sltune.profiling import forks


@dataclass(frozen=True)
class Footprint:
    """Bytes, for one sub-batch of b rows of s tokens; each peak is above what the step held before it began."""

    hidden: int             # one boundary activation: b*s*hidden*itemsize
    kept: int               # what each sub-batch's prologue leaves for the rest of the step: the layer arguments
                            # it records (rotary tables, masks) and its autograd graph's saved tensors
    prologue: int           # peak of the prologue, its output and `kept` included
    forward: int            # peak of a no-grad forward through a body group (its output included)
    backward: int           # recompute: a body group's forward with autograd, then its backward (the input's
                            # gradient included)
    turnaround: int         # the last group, the head and the loss, forward and backward at once
    embed_backward: int     # the embedding's backward from its output's gradient
    saved: int              # what autograd saves in a body group's forward, parameters excluded (offload's S)
    saved_embed: int        # ... in the prologue's
    held_forward: int       # what a body group's forward with autograd holds at its end (saved tensors, output)
    resident: int           # the resident schedule: the whole model's forward, loss and backward on one sub-batch


def footprint(source: Any, dtype: str, b: int, s: int, k: int, last_k: int, mode: str = "train",
              resident: bool = False, grads_kept: bool = True, depth: int | None = None) -> Footprint:
    """The footprint of a config: `k` layers a body group, `last_k` the last group's, `depth` the layers the
    resident schedule runs at once (default: the model's). `grads_kept`: the parameters' gradients are buffers
    the step adds into (the engine's), else autograd's own, which each traced backward allocates (the resident
    schedule without a float32 master; the speedloader schedule under one, whose flush adds them into the float32
    sums and drops them after every sub-batch: sltune.runtime.params.flush_grads).

    Traced with groups of one and of two layers, then extended layer by layer: a forward without autograd
    frees each layer's intermediates before the next (two layers show its peak: one's output beside the next
    one's work), and with autograd every layer holds what it saves, the same for every layer of a model
    (families with sliding-window layers mix two kinds: within a few percent)."""
    key = json.dumps(source, sort_keys=True, default=str)
    one, two, model_layers = _traces(key, dtype, b, s, mode, resident, grads_kept)
    depth = depth or model_layers

    def grow(field: str, layers: int) -> int:
        x, y = getattr(one, field), getattr(two, field)
        return x + max(layers - 1, 0) * (y - x)

    return Footprint(one.hidden, one.kept, one.prologue, one.forward if k == 1 else two.forward,
                     grow("backward", k), grow("turnaround", last_k), one.embed_backward, grow("saved", k),
                     one.saved_embed, grow("held_forward", k), grow("resident", depth) if resident else 0)




@lru_cache(maxsize=256)
def _traces(key: str, dtype: str, b: int, s: int, mode: str, resident: bool,
            grads_kept: bool) -> tuple[Footprint, Footprint, int]:
    """The traces of groups of one and of two layers, and the model's layers (sltune.tuning.cost.tracing)."""
    return forks.call("sltune.tuning.cost.tracing:traced", key, dtype, b, s, mode, resident, grads_kept)
