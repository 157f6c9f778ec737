"""What `sltune calibrate SPEC` measures at: the spec's model's own matmuls and attention in its dtype, over the row
counts its search spans. Rates at another shape or dtype say little about these (a bfloat16 matmul on a CPU without
bf16 instructions runs at a hundredth of float32's rate)."""

from __future__ import annotations

from sltune.machine import Workload
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.knobs import knob_values
from sltune.tuning.spec import TuningSpec


def workload_of(spec: TuningSpec) -> Workload:
    """A decoder layer's weight matrices as matmuls from `hidden` to numel / hidden, and back where that is wider
    (the MLP's down projection: a shape's parameter sizes do not say which way a matrix maps), and the head's
    (hidden, vocab); rows at the search's smallest, middle and largest sub_batch_size times the tokens per row. The
    backward's matmuls do the same work on transposed operands and are not timed apart."""
    shape = shape_of(spec.model.source, spec.model.dtype)
    widths = {n // shape.hidden for n in shape.layer_numels if n % shape.hidden == 0 and n // shape.hidden > 1}
    matmuls = sorted({(shape.hidden, w) for w in widths} | {(w, shape.hidden) for w in widths if w > shape.hidden}
                     | {(shape.hidden, shape.vocab)})
    tokens = spec.workload.seq_len if spec.workload.mode == "train" else spec.workload.prompt_len
    sizes = knob_values(spec.search.sub_batch_size, "sub_batch_size")
    rows = tuple(sorted({sizes[0] * tokens, sizes[len(sizes) // 2] * tokens, sizes[-1] * tokens}))
    head_dim = shape.head_dim or 64
    return Workload(matmuls=tuple(matmuls), rows=rows, hidden=shape.hidden, heads=max(1, shape.hidden // head_dim),
                    head_dim=head_dim, seq_len=tokens, dtype=spec.model.dtype, param_numels=shape.layer_numels)
