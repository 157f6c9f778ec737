"""Learning-rate schedules (sltune.training.schedule): `sltune train`'s learning rates equal transformers' schedules
step for step."""

import pytest
import torch
from transformers import optimization as hf

from tests.support.training import log, train


@pytest.mark.parametrize("schedule,min_lr,reference", [
    ("constant", 0.0, lambda o: hf.get_constant_schedule_with_warmup(o, 2)),
    ("linear", 0.0, lambda o: hf.get_linear_schedule_with_warmup(o, 2, 7)),
    ("linear", 2e-4, lambda o: hf.get_polynomial_decay_schedule_with_warmup(o, 2, 7, lr_end=2e-4)),
    ("cosine", 0.0, lambda o: hf.get_cosine_schedule_with_warmup(o, 2, 7)),
    ("cosine", 2e-4, lambda o: hf.get_cosine_with_min_lr_schedule_with_warmup(o, 2, 7, min_lr=2e-4)),
])
def test_learning_rates_equal_transformers_schedules_step_for_step(tmp_path, schedule, min_lr, reference):
    args = ["--lr-schedule", schedule, "--warmup-steps", "2", "--steps", "7", "--lr", "1e-3", "--json"]
    if min_lr:
        args += ["--min-lr", str(min_lr)]
    assert train(*args, "--log", str(tmp_path / "m.jsonl")) == 0
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched, expected = reference(opt), []
    for _ in range(7):                       # transformers' Trainer: the step, then the scheduler
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [s["lr"] for s in log(tmp_path / "m.jsonl")] == pytest.approx(expected, rel=1e-12, abs=1e-15)
