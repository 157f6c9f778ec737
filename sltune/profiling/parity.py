"""Correctness before speed: a trial's step-1 loss against plain PyTorch's on the same weights and batch.

The reference is the model's own forward with labels (transformers' loss) on the trial's first batch, from
the step-0 weights every backend starts from, in the trial's dtype: what any correct backend's first step
must report, before any update. It runs b rows at a time (one micro-batch's logits is what a step held
anyway), on a GPU trial's device when the whole model fits there, else on the host (the model of a
SpeedLoader trial need not fit the device); after the trial's measurements, with the backend released
first, so it changes none of the trial's figures. It costs a model build and a forward over the step's rows,
inside the trial's timeout.

Tolerances are relative, by dtype. Two correct runs may differ in summation order (micro-batches against the
whole batch, other kernels on another device, the ranks' sums) and, under a low precision, in where values are
rounded. On one CPU every backend here matches the reference to the bit (rel_diff 0 for SpeedLoader,
DeepSpeed ZeRO-2/3 and FSDP2, float32 and bfloat16, on the tiny presets); the tolerances are for the rest:
  float32   1e-4: float32's unit roundoff is 6e-8; a mean over thousands of tokens summed in another order
            moves by ~1e-6. 100x that is still far below what a real bug does (a loss scaled by the
            accumulation count, a wrong batch, weights or labels move it by 1e-3 to 1e0).
  bfloat16  2e-2: 8 significant bits, a unit roundoff of 2^-8 (3.9e-3) on every weight and activation; the
            loss is computed in float32 from bfloat16 logits, and two correct runs' logits differ by a few
            roundings where their kernels accumulate differently. 2e-2 is five roundoffs, room for a loaded
            checkpoint's larger logits on another device's kernels; a doubled or halved loss is 25x outside.
  float16   2.5e-3: 11 significant bits (unit roundoff 4.9e-4); five roundoffs, as for bfloat16.
A model with dropout draws different masks in every run, so its reference is the mean of a few draws in
training mode, and the tolerance widens by the spread the draws show (8 standard errors).

A reference that is not finite is no backend's fault: the model's tensors are then searched for NaN and infinity
once (one pass over the weights the reference ran), and the parity's `cause` names the first such tensor, or, all
finite, says the model overflows its dtype on the batch; every config of that model would fail the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sltune.backends.base import TrainingSpec, full_model, torch_dtype

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2.5e-3}
DROPOUT_DRAWS = 4


def has_dropout(config: Any) -> bool:
    """Whether the model drops values in training (any dropout probability in its config above zero)."""
    return any(("dropout" in k or "pdrop" in k) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
               for k, v in config.to_dict().items())


def reference_loss(spec: TrainingSpec, ids: torch.Tensor) -> tuple[float, float, str | None]:
    """(plain PyTorch's mean token loss on `ids` from the step-0 weights, the relative allowance its dropout adds,
    why that loss is not finite when it is not: `not_finite`).

    `ids`: every rank's first batch, one after the other (each row has as many tokens, so the mean of the
    micro-batches' means is the mean over them all, as the backends report it)."""
    model = full_model(spec, torch_dtype(spec.dtype))
    model.config.use_cache = False
    model.train()       # as the backend's first step ran; identical to eval without dropout
    draws = DROPOUT_DRAWS if has_dropout(model.config) else 1
    b = spec.sub_batch_size
    ids = ids.to(_place(model, torch.device(spec.device)))
    losses = []
    with torch.no_grad(), torch.random.fork_rng(devices=[ids.device] if ids.is_cuda else []):
        for draw in range(draws):
            torch.manual_seed(spec.seed + 1 + draw)
            parts = [model(input_ids=ids[i:i + b], labels=ids[i:i + b]).loss.float() for i in range(0, len(ids), b)]
            losses.append(torch.stack(parts).mean())
    per_draw = torch.stack(losses).float().cpu()
    mean = float(per_draw.mean())
    cause = None if math.isfinite(mean) else not_finite(model, spec.dtype)
    del model
    if draws == 1:
        return mean, 0.0, cause
    spread = float(per_draw.std()) * math.sqrt(1 + 1 / draws)     # the run's one draw against the draws' mean
    return mean, 8 * spread / abs(mean), cause


def not_finite(model: torch.nn.Module, dtype: str) -> str:
    """Why a model's own loss is not finite: the first of its tensors (parameters, then buffers) holding NaN or
    infinity, and how many values do; else, every tensor finite, its activations overflowing `dtype`."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_floating_point():
            continue
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            what = " and ".join(f"{n:,} {kind}" for n, kind in ((nan, "NaN"), (inf, "infinite")) if n)
            return (f"the model's weights are not finite: {name} holds {what} value(s) of {t.numel():,}; no config "
                    "can train it: fix or replace the weights")
    return (f"every weight is finite, but the model's own loss on the batch is not: its activations overflow "
            f"{dtype} on this data; train it in float32 (or bfloat16), or check the weights' scale")


def _place(model: torch.nn.Module, device: torch.device) -> torch.device:
    """The device the reference runs on: a GPU trial's when the whole model fits there, else the host."""
    if device.type != "cuda":
        return torch.device("cpu")
    try:
        model.to(device)
        return device
    except torch.OutOfMemoryError:
        model.to("cpu")
        torch.cuda.empty_cache()
        return torch.device("cpu")


def parity(loss: float, reference: float, dtype: str, allowance: float = 0.0,
           cause: str | None = None) -> dict[str, Any]:
    """TrialResult.parity: the relative difference against the tolerance of the dtype (plus any allowance); with
    `cause`, why the reference itself is not finite (reference_loss)."""
    rel = abs(loss - reference) / max(abs(reference), 1e-12)
    tolerance = TOLERANCE[dtype] + allowance
    ok = math.isfinite(loss) and rel <= tolerance
    return {"loss": loss, "reference_loss": reference, "rel_diff": rel, "tolerance": tolerance, "ok": ok,
            "cause": cause}
