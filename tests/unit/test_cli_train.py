"""`sltune train` as a user runs it: its flags, its output and its one-line errors."""

import json

import numpy as np

from sltune import SpeedLoaderConfig
from tests.support.cli import sltune


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
