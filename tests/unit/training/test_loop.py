"""The loop a training job runs (sltune.training.loop, `sltune train`): exact resume, evaluation, the flags' errors.
In-process through the CLI's own entry point, as a user's command line runs it."""

import pytest
import torch
from safetensors.torch import load_file

from sltune.cli.main import main
from sltune.models import build
from tests.support.training import KNOBS, log, train


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A bfloat16 GQA checkpoint: the saved weights are bf16, the masters float32 (resume reads those)."""
    path = tmp_path_factory.mktemp("src")
    build("llama-tiny", seed=5).to(torch.bfloat16).save_pretrained(path)
    return path


def test_resume_continues_exactly_where_the_run_stopped(source, tmp_path):
    common = ["--model", str(source), "--dtype", "bfloat16", "--warmup-steps", "2", "--max-grad-norm", "0.5",
              "--lr", "3e-3", "--json"]
    assert train(*common, "--steps", "6", "--save", str(tmp_path / "straight"), "--log", str(tmp_path / "a")) == 0
    assert train(*common, "--steps", "3", "--save-every", "3", "--save", str(tmp_path / "run")) == 0
    assert (tmp_path / "run" / "training_state" / "weights.safetensors").is_file()   # bf16 folder, f32 masters
    assert train(*common, "--steps", "6", "--resume", str(tmp_path / "run"), "--save", str(tmp_path / "run"),
                 "--log", str(tmp_path / "b")) == 0
    straight, resumed = log(tmp_path / "a"), log(tmp_path / "b")
    assert [s["step"] for s in resumed] == [4, 5, 6]
    for a, b in zip(straight[3:], resumed):
        assert (a["loss"], a["lr"], a["grad_norm"]) == (b["loss"], b["lr"], b["grad_norm"])
    for file in ("model.safetensors", "training_state/weights.safetensors"):
        x, y = load_file(tmp_path / "straight" / file), load_file(tmp_path / "run" / file)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), file


def test_an_interrupted_decaying_schedule_resumes_from_its_checkpoint(tmp_path):
    """--save-every writes checkpoint-N with the state of step N; resuming one continues the cosine decay of
    the run's total as if nothing had stopped it. --keep keeps the newest."""
    common = ["--model", "llama-tiny", "--lr-schedule", "cosine", "--warmup-steps", "1", "--min-lr", "1e-4",
              "--steps", "6", "--json"]
    assert train(*common, "--save-every", "2", "--keep", "1", "--save", str(tmp_path / "a"),
                 "--log", str(tmp_path / "a.jsonl")) == 0
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == ["checkpoint-4"]
    assert train(*common, "--resume", str(tmp_path / "a" / "checkpoint-4"), "--log", str(tmp_path / "b.jsonl")) == 0
    straight, resumed = log(tmp_path / "a.jsonl"), log(tmp_path / "b.jsonl")
    assert [(s["step"], s["loss"], s["lr"]) for s in straight[4:]] == [(s["step"], s["loss"], s["lr"]) for s in resumed]
    assert main(["train", *KNOBS, *common, "--resume", str(tmp_path / "a")]) == 2     # step 6 of 6: nothing left


def test_eval_every_reports_the_held_out_loss_and_the_log_has_every_field(tmp_path, capsys):
    tokens = tmp_path / "tokens.npy"
    import numpy as np

    np.save(tokens, np.random.default_rng(0).integers(3, 500, 4000))
    assert train("--steps", "4", "--data", str(tokens), "--eval-every", "2", "--holdout", "0.1",
                 "--log", str(tmp_path / "m.jsonl")) == 0
    lines = log(tmp_path / "m.jsonl")
    assert set(lines[0]) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s", "loss_scale", "skipped"}
    assert [s["step"] for s in lines if "eval_loss" in s] == [2, 4]
    assert all(0 < s["eval_loss"] < 10 for s in lines if "eval_loss" in s)
    assert "held-out loss" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--lr", "-1"], "--lr: Input should be greater than 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--save-every", "2"], "pass --save DIR"),
    (["--eval-every", "2", "--holdout", "0"], "--holdout"),
    (["--lr-schedule", "constant", "--min-lr", "1e-4"], "--min-lr applies to the linear and cosine"),
    (["--warmup-steps", "30"], "--warmup-steps 30 must be from 0 to --steps"),
    (["--world-size", "2"], "pass --world-size 1, or launch 2 with torchrun"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
])
def test_bad_training_flags_name_the_flag_and_the_fix(tmp_path, capsys, args, message):
    assert train("--steps", "3", *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
