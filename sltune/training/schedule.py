"""Learning-rate schedules: transformers' own, so a job's learning rates equal the Trainer's step for step.

The scheduler steps after the optimizer, as transformers' Trainer does: step 1 runs at the schedule's value
for step 0 (zero under warmup). `min_lr` is the floor the decay ends at (absolute, in learning-rate units).
A resumed run follows the schedule of its own total (`--steps`), from the step it resumes at.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:       # `sltune train -h` lists the schedules without loading torch
    import torch
    from torch.optim.lr_scheduler import LambdaLR

LRSchedule = Literal["constant", "linear", "cosine"]
SCHEDULES = ("constant", "linear", "cosine")


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule, warmup_steps: int, total_steps: int,
                 min_lr: float = 0.0, done: int = 0) -> LambdaLR:
    """The schedule over `total_steps`, positioned after `done` steps (a resumed run: the optimizer's state,
    already loaded, holds the peak as initial_lr). constant: transformers' get_constant_schedule_with_warmup;
    linear: get_linear_schedule_with_warmup, or with a floor get_polynomial_decay_schedule_with_warmup(power=1);
    cosine: get_cosine_with_min_lr_schedule_with_warmup (min_lr 0 is get_cosine_schedule_with_warmup)."""
    from transformers import optimization as hf

    group = optimizer.param_groups[0]
    peak = group.get("initial_lr", group["lr"])
    if schedule not in SCHEDULES:
        raise ValueError(f"--lr-schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0 or warmup_steps > total_steps:
        raise ValueError(f"--warmup-steps {warmup_steps} must be from 0 to --steps ({total_steps})")
    if not 0 <= min_lr < peak:
        raise ValueError(f"--min-lr {min_lr:g} must be >= 0 and below the learning rate {peak:g}")
    if schedule == "constant":
        if min_lr:
            raise ValueError("--min-lr applies to the linear and cosine schedules; drop it or pick one of them")
        return hf.get_constant_schedule_with_warmup(optimizer, warmup_steps, last_epoch=done - 1)
    if schedule == "linear":
        if min_lr == 0:
            return hf.get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps, last_epoch=done - 1)
        return hf.get_polynomial_decay_schedule_with_warmup(optimizer, warmup_steps, total_steps, lr_end=min_lr,
                                                            power=1.0, last_epoch=done - 1)
    return hf.get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup_steps, total_steps, min_lr=min_lr,
                                                          last_epoch=done - 1)
