"""What happens to a step's gradients between the backward and the optimizer: loss scaling, the global norm,
clipping.

float16 has a narrow range: small gradients underflow to zero. Dynamic loss scaling (torch.amp.GradScaler's
policy, kept here because the gradients it checks live in the engine's host buffers, sharded over ranks)
multiplies the loss by a scale before the backward; a step whose gradients overflow is skipped and the scale
halves; after `growth_interval` good steps in a row it doubles. The norm is the one of
torch.nn.utils.clip_grad_norm_ on the whole model: every parameter once (a tied weight once), over every rank's
shard, of the unscaled gradients. One pass gives both the norm and the overflow check (an inf or NaN gradient
makes the norm non-finite).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist


class LossScaler:
    """GradScaler's dynamic scale: start at 2**16, halve on overflow, double after 2000 clean steps."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])


@dataclass
class GradStep:
    """What finishing a step's gradients decided."""

    norm: float | None       # the global norm of the unscaled gradients (None when not computed)
    skip: bool                # an overflow under loss scaling: no optimizer step
    coef: float = 1.0         # what the gradients were (or, streamed, are to be) multiplied by: unscale and clip


def square_of(grad: torch.Tensor) -> torch.Tensor:
    """One flat buffer's squared norm: float32 norm, squared in float64 (streamed gradients take the same,
    sltune.runtime.disk.gradwindow, so the global norm is the same to the bit)."""
    return torch.linalg.vector_norm(grad, dtype=torch.float32).double() ** 2


def squared_norm(squares: Iterable[torch.Tensor]) -> torch.Tensor:
    """The float64 sum of the buffers' squares (square_of), in order."""
    total = torch.zeros((), dtype=torch.float64)
    for square in squares:
        total += square
    return total


def finish_grads(grads: list[torch.Tensor], scale: float = 1.0, max_norm: float | None = None,
                 need_norm: bool = False, world: int = 1, square: torch.Tensor | None = None) -> GradStep:
    """Unscale and clip the flat gradients in place (one multiply), or report an overflow.

    `grads` are this rank's flat gradient buffers, each parameter once; sharded, the squares are summed over
    ranks so every rank sees the same norm and takes the same decision. `square`: the squared norm taken as the
    gradients streamed by (sltune.runtime.disk.gradwindow), with `grads` empty; the step then applies the
    coefficient."""
    scaled = scale != 1.0
    if not (need_norm or scaled or max_norm is not None):
        return GradStep(None, False)
    if square is None:
        square = squared_norm(square_of(g) for g in grads)
    if world > 1:
        dist.all_reduce(square)
    norm = math.sqrt(float(square)) / scale
    if scaled and not math.isfinite(norm):
        return GradStep(norm, True)
    coef = 1.0 / scale
    if max_norm is not None:
        coef *= min(1.0, max_norm / (norm + 1e-6))     # torch.nn.utils.clip_grad_norm_'s coefficient
    if coef != 1.0:
        for g in grads:
            g.mul_(coef)
    return GradStep(norm, False, coef)


def warn_vanishing_eps(opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Without a float32 master (mixed_precision false) the optimizer steps the engine's dtype, so an eps that
    rounds to 0 there turns zero gradients into 0/0 = NaN, as it would for model.half() in plain PyTorch."""
    for group in opt.param_groups:
        eps = group.get("eps")
        if isinstance(eps, float) and eps > 0 and torch.tensor(eps, dtype=dtype).item() == 0.0:
            warnings.warn(f"optimizer eps={eps:g} is 0 in {str(dtype).removeprefix('torch.')}: zero gradients will "
                          "give NaN updates; use eps >= 1e-4 or dtype='bfloat16'", UserWarning, stacklevel=3)
            return
