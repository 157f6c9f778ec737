"""Issue #47, item 4: a parity failure whose losses are not finite names the cause, the model's own, not the config's:
a real trial (its own process) of a model folder whose weights hold NaN or infinity, against one whose weights are
finite but overflow the dtype, and against a config that is wrong (the one case that is the config's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sltune.models import build
from sltune.profiling import run_trial
from sltune.profiling.schema import TrialSpec

TRIAL = dict(seq_len=16, steps=1, min_time_s=0, profile=False)


def folder_with(tmp_path: Path, name: str, change) -> Path:
    model = build("llama-tiny")
    with torch.no_grad():
        change(model)
    model.save_pretrained(tmp_path / name)
    return tmp_path / name


def test_non_finite_weights_are_named_as_the_cause_not_the_config(tmp_path):
    def poison(model) -> None:
        w = model.model.layers[1].mlp.down_proj.weight
        w[0, :3] = float("nan")
        w[1, 0] = float("inf")

    r = run_trial(TrialSpec(model=str(folder_with(tmp_path, "nan", poison)), **TRIAL))
    assert r.status == "diverged", r
    assert "model.layers.1.mlp.down_proj.weight holds 3 NaN and 1 infinite value(s) of 11,264" in r.error, r.error
    assert "the model's weights are not finite" in r.error and "no config can train it" in r.error, r.error
    assert "does not train the model correctly" not in r.error and "\n" not in r.error
    assert r.parity is not None and r.parity.cause and not r.parity.ok


def test_finite_weights_whose_loss_overflows_name_the_data_and_dtype(tmp_path):
    def huge(model) -> None:
        model.lm_head.weight.fill_(3e38)            # finite in float32 (max 3.4e38); the logits overflow

    r = run_trial(TrialSpec(model=str(folder_with(tmp_path, "huge", huge)), **TRIAL))
    assert r.status == "diverged", r
    assert "every weight is finite, but the model's own loss on the batch is not" in r.error, r.error
    assert "overflow float32 on this data" in r.error


def test_a_finite_model_keeps_the_configs_own_verdict(tmp_path):
    r = run_trial(TrialSpec(model=str(folder_with(tmp_path, "fine", lambda m: None)), **TRIAL))
    assert r.status == "ok" and r.parity.ok and r.parity.cause is None, r
