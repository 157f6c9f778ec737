"""The input embedding's gradient as the rows a sub-batch touched, added into the step's sum to the bit.

A dense embedding backward makes a vocabulary-sized gradient per sub-batch (zero-filled, b*s rows written) and
the sum then adds all of it: at qwen2-0.5b's 151936 x 896 that is 2 x 545 MB of memory traffic per sub-batch
for a few hundred rows, 19% of a b=1 step on the CPU (bench/backends.py, docs/benchmarks.md). For the span of
the engine's own embedding forward the module is switched to nn.Embedding's `sparse=True` (the user's model is
left as it was), so its backward hands over the touched rows; `add_rows` sums each row's repeats in the order
the dense backward does and adds every row once, so the result equals the dense path's bit for bit on the CPU
(tests/unit/runtime/test_rowgrads.py; CUDA's dense backward sums repeats in an order of its own, so there the two
agree to rounding). The tuner's prior still counts the dense gradient (sltune.tuning.cost.footprint: the meta device
cannot run the sparse backward of an embedding with a padding_idx), which over-predicts by at most that gradient.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def row_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's input embedding when its gradient can come as rows: an nn.Embedding (or a subclass, which
    calls its forward) that trains and does not scale its gradient by frequency."""
    m = model.get_input_embeddings()
    ok = isinstance(m, nn.Embedding) and m.weight.requires_grad and not m.scale_grad_by_freq
    return m if ok else None


@contextlib.contextmanager
def sparse_rows(module: nn.Embedding | None) -> Iterator[None]:
    """Within: `module`'s backward gives a sparse gradient of the touched rows. None: nothing changes."""
    if module is None:
        yield
        return
    before, module.sparse = module.sparse, True
    try:
        yield
    finally:
        module.sparse = before


def add_rows(dst: torch.Tensor, grad: torch.Tensor) -> None:
    """dst += grad for `grad` a sparse gradient of rows (uncoalesced: an index and a row per token): each row's
    repeats summed first, in the gradient's dtype and token order as the dense backward sums them, then each
    touched row of dst added to once."""
    index, values = grad._indices()[0], grad._values()
    rows, where = torch.unique(index, return_inverse=True)
    # to_dense sums an uncoalesced tensor's repeats as the dense backward does (index_add_ does not, in bfloat16)
    summed = torch.sparse_coo_tensor(where[None], values, (rows.numel(), *values.shape[1:]),
                                     check_invariants=False).to_dense()
    dst.index_add_(0, rows, summed.to(dst.dtype))


def take_rows(p: nn.Parameter, held: torch.Tensor | None) -> None:
    """After a backward that gave `p` a sparse gradient: with `held` (the gradient p had before it, taken away
    so autograd would not add rows into it in an order of its own) the rows are added into it and it is p's
    gradient again; without, p keeps the sparse gradient (a master's flush adds it into the float32 sum)."""
    if held is None:
        return
    g, p.grad = p.grad, held
    if g is None:
        return
    if g.is_sparse:
        add_rows(held, g)
    else:
        held.add_(g)
