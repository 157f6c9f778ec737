"""`sltune train` as a user runs it (sltune.cli.train): its flags, its output and its one-line errors, and a
best.yaml alone naming the model, seq_len and dtype it was tuned on."""

import json

import numpy as np

from sltune import SpeedLoaderConfig
from sltune.cli.main import main
from tests.support.cli import sltune
from tests.support.configs import tuned_file


def test_train_from_a_config_file_prints_progress_and_throughput(tmp_path):
    cfg = tmp_path / "best.yaml"
    SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2, num_live_blocks=2).to_yaml(cfg)
    out = sltune("train", "--config", str(cfg), "--model", "llama-tiny", "--seq-len", "16", "--steps", "12",
                 "--lr", "3e-3")
    assert out.returncode == 0, out.stderr
    assert "12/12" in out.stderr                      # the progress bar
    assert "tokens/s" in out.stdout and "trained 12 steps" in out.stdout


def test_train_json_on_a_token_file_and_flags_override_the_file(tmp_path):
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(3, 500, 5000))
    out = sltune("train", "--model", "gpt2-tiny", "--seq-len", "16", "--steps", "3", "--data", str(data),
                 "--sub-batch-size", "1", "--num-sub-batches", "3", "--schedule", "canonical",
                 "--activations", "offload", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["steps"] == 3 and summary["tokens_per_s"] > 0
    assert summary["config"]["schedule"] == "canonical" and summary["config"]["num_sub_batches"] == 3
    assert summary["config"]["activations"] == "offload"
    assert summary["io_per_step"]["param_load_bytes"] > 0


def test_train_reports_bad_input_without_a_traceback(tmp_path):
    out = sltune("train", "--model", "no-such-model", "--steps", "1")
    assert out.returncode == 2
    assert "preset" in out.stderr and "Traceback" not in out.stderr
    out = sltune("train", "--activations", "sometimes", "--steps", "1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "activations" in out.stderr and "'offload'" in out.stderr


def test_train_with_only_the_config_trains_the_model_seq_len_and_dtype_it_names(tmp_path):
    out = sltune("train", "--config", str(tuned_file(tmp_path / "best.yaml")), "--steps", "1", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    # what the job tuned, not the defaults (llama-tiny, 128, float32)
    assert (summary["model"], summary["seq_len"], summary["config"]["dtype"]) == ("gpt2-tiny", 16, "bfloat16")


def test_a_bad_train_flag_is_refused_before_the_progress_bar_and_names_the_flag(capsys):
    """Issue #23: `train --seed -1` was accepted (and then refused only once the bar had started), `--lr -1`
    gave torch's "Invalid learning rate: -1.0", which names no flag."""
    for flags, said in ((["--seed", "-1"], "--seed must be >= 0, got -1"), (["--lr", "-1"], "--lr")):
        assert main(["train", "--model", "llama-tiny", "--steps", "1", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("sltune train: error: ") and said in err and err.count("\n") == 1, err
        assert "step/s" not in err and "0/1" not in err            # no bar was drawn before the refusal
