"""What `sltune calibrate SPEC` measures at: the spec's model's own matmuls and attention in its dtype, over the row
counts its search spans. Rates at another shape or dtype say little about these (a bfloat16 matmul on a CPU without
bf16 instructions runs at a hundredth of float32's rate)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from sltune.machine import Workload
from sltune.tuning.cost.shape import ModelShape, shape_of
from sltune.tuning.knobs import knob_values
from sltune.tuning.spec import TuningSpec


def workload_of(spec: TuningSpec) -> Workload:
    """The spec's model at rows of the search's smallest, middle and largest sub_batch_size times the tokens per
    row (workload_for); in generation also at those sub_batch_sizes alone, a decode step's rows, over the positions
    its attention reads at most."""
    w = spec.workload
    tokens = w.seq_len if w.mode == "train" else w.prompt_len
    sizes = knob_values(spec.search.sub_batch_size, "sub_batch_size")
    spanned = (sizes[0], sizes[len(sizes) // 2], sizes[-1])
    workload = workload_for(shape_of(spec.model.source, spec.model.dtype), tokens, (b * tokens for b in spanned))
    if w.mode == "train":
        return workload
    return dataclasses.replace(workload, decode_rows=tuple(sorted(set(spanned))), kv_len=w.prompt_len + w.new_tokens)


def workload_for(shape: ModelShape, tokens: int, rows: Iterable[int]) -> Workload:
    """A decoder layer's weight matrices as matmuls from `hidden` to numel / hidden (layer_widths), and back where
    that is wider (the MLP's down projection: a shape's parameter sizes do not say which way a matrix maps), and the
    head's (hidden, vocab), at `rows`; attention over `tokens` per row. The backward's matmuls do the same work on
    transposed operands and are not timed apart."""
    widths = layer_widths(shape)
    matmuls = sorted({(shape.hidden, w) for w in widths} | {(w, shape.hidden) for w in widths if w > shape.hidden}
                     | {(shape.hidden, shape.vocab)})
    head_dim = shape.head_dim or 64
    return Workload(matmuls=tuple(matmuls), rows=tuple(sorted(set(rows))), hidden=shape.hidden,
                    heads=max(1, shape.hidden // head_dim), head_dim=head_dim, seq_len=tokens, dtype=shape.dtype,
                    param_numels=shape.layer_numels)


def layer_widths(shape: ModelShape) -> list[int]:
    """Per weight matrix of a decoder layer (in layer_numels' order), the width it maps `hidden` to; norms and
    biases (one value per hidden unit, or fewer) are no matmul."""
    return [n // shape.hidden for n in shape.layer_numels if n % shape.hidden == 0 and n // shape.hidden > 1]
