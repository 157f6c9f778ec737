"""The first hour with the `sltune` command: train what was tuned from best.yaml alone, and every mistake
answered in one line naming the field and the fix (a traceback only with --debug)."""

import json
import subprocess
import sys

from sltune import SpeedLoaderConfig
from sltune.cli.main import main


def sltune(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "sltune", *args], capture_output=True, text=True, timeout=timeout)


def tuned_file(path, device_memory_limit=None):
    """A best.yaml as a job exports it: knobs, then the workload and model it was tuned on."""
    SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2, num_live_blocks=1, dtype="bfloat16",
                      device_memory_limit=device_memory_limit).to_yaml(
        path, workload={"mode": "train", "seq_len": 16, "world_size": 1},
        provenance={"job_id": "j", "model": {"preset": "gpt2-tiny", "dtype": "bfloat16"}})
    return path


def test_train_with_only_the_config_trains_what_was_tuned(tmp_path):
    probe = sltune("train", "--config", str(tuned_file(tmp_path / "probe.yaml")), "--steps", "1", "--json")
    assert probe.returncode == 0, probe.stderr
    measured = json.loads(probe.stdout)
    # the model, seq_len and dtype the job tuned, not the defaults (llama-tiny, 128, float32)
    assert (measured["model"], measured["seq_len"], measured["config"]["dtype"]) == ("gpt2-tiny", 16, "bfloat16")

    # a limit the tuned seq_len fits under, which 128 tokens per row would cross
    best = tuned_file(tmp_path / "best.yaml", device_memory_limit=int(measured["peak_device_bytes"] * 1.5))
    out = sltune("train", "--config", str(best), "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert "train gpt2-tiny s=16" in out.stderr and "trained 2 steps" in out.stdout

    over = sltune("train", "--config", str(best), "--steps", "2", "--seq-len", "128")   # a flag overrides the file
    assert over.returncode == 2
    last = over.stderr.strip().splitlines()[-1]
    assert "Traceback" not in over.stderr
    assert last.startswith("sltune train: error: device memory limit exceeded")
    assert f"device_memory_limit in {best}" in last and "--device-memory-limit" in last


def test_a_malformed_yaml_is_one_line_naming_where_and_debug_shows_the_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sub_batch_size: 2\nnum_live_blocks: 1: 2\n")
    for command in (["train", "--config", str(bad)], ["tune", str(bad)], ["plan", "--from", str(bad)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{bad} line 2, column " in err and "not valid YAML" in err and "fix the syntax" in err
    assert main(["--debug", "train", "--config", str(bad)]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    assert main(["train", "--config", str(bad), "--debug"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_bad_flag_value_names_the_flag_not_the_file(tmp_path, capsys):
    assert main(["plan", "--from", str(tuned_file(tmp_path / "best.yaml")), "--device-memory-limit", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sltune plan: error: --device-memory-limit: cannot read 'lots' as a byte size; write")
    assert "best.yaml" not in err and err.count("device_memory_limit") == 0


def test_a_missing_file_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"sltune train: error: {tmp_path / 'nope.yaml'}: No such file or directory\n"
