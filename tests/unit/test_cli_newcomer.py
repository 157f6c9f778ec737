"""The first hour with the `sltune` command: train what was tuned from best.yaml alone, and every mistake
answered in one line naming the field and the fix (a traceback only with --debug)."""

import argparse
import json
from pathlib import Path

import pytest

from sltune import SpeedLoaderConfig
from sltune.cli.main import main, parser
from tests.support.cli import sltune


def tuned_file(path):
    """A best.yaml as a job exports it: knobs, then the workload and model it was tuned on."""
    SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2, num_live_blocks=1, dtype="bfloat16").to_yaml(
        path, workload={"mode": "train", "seq_len": 16, "world_size": 1},
        provenance={"job_id": "j", "model": {"preset": "gpt2-tiny", "dtype": "bfloat16"}})
    return path


def test_train_with_only_the_config_trains_the_model_seq_len_and_dtype_it_names(tmp_path):
    out = sltune("train", "--config", str(tuned_file(tmp_path / "best.yaml")), "--steps", "1", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    # what the job tuned, not the defaults (llama-tiny, 128, float32)
    assert (summary["model"], summary["seq_len"], summary["config"]["dtype"]) == ("gpt2-tiny", 16, "bfloat16")


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


def test_a_bad_service_setting_names_the_flag_or_the_variable_it_came_from(capsys, monkeypatch):
    assert main(["serve", "--workers", "0"]) == 2
    assert capsys.readouterr().err == "sltune serve: error: --workers: Input should be greater than or equal to 1\n"
    monkeypatch.setenv("SLTUNE_API_WORKERS", "0")
    assert main(["serve"]) == 2
    assert capsys.readouterr().err == ("sltune serve: error: SLTUNE_API_WORKERS: Input should be greater than or "
                                       "equal to 1\n")


def test_a_bad_value_in_a_flag_built_model_is_one_line_naming_the_field(capsys):
    assert main(["profile", "--device-memory-limit", "lots"]) == 2
    err = capsys.readouterr().err
    assert err == ("sltune profile: error: --device-memory-limit: cannot read 'lots' as a byte size; write a number "
                   "of bytes or a number with a unit such as '512MiB', '2GiB' or '8GB'\n")


def test_a_share_of_weights_outside_0_to_1_is_one_line_naming_the_flag(capsys):
    for value in ("2", "-0.5", "nan"):
        assert main(["profile", "--mode", "generate", "--weights-on-device", value]) == 2
        assert capsys.readouterr().err == ("sltune profile: error: --weights-on-device: give a share from 0 (no "
                                           "weights kept on the device) to 1 (all of them), not "
                                           f"{float(value):g}\n")


def test_a_bad_knob_flag_names_the_flag_once(capsys):
    """Issue #23: `train --device-memory-limit=-1GiB` said "device_memory_limit: device_memory_limit: cannot
    read ...", naming the field twice and the flag not at all."""
    assert main(["train", "--device-memory-limit=-1GiB", "--steps", "1"]) == 2
    assert capsys.readouterr().err == ("sltune train: error: --device-memory-limit: cannot read '-1GiB' as a byte "
                                       "size; write a number of bytes or a number with a unit such as '512MiB', "
                                       "'2GiB' or '8GB'\n")
    with pytest.raises(ValueError) as err:
        SpeedLoaderConfig.from_dict({"device_memory_limit": "-1GiB"}, source="best.yaml")
    assert str(err.value).startswith("best.yaml: device_memory_limit: cannot read '-1GiB'")
    assert str(err.value).count("device_memory_limit") == 1


def test_a_bad_train_flag_is_refused_before_the_progress_bar_and_names_the_flag(capsys):
    """Issue #23: `train --seed -1` was accepted (and then refused only once the bar had started), `--lr -1`
    gave torch's "Invalid learning rate: -1.0", which names no flag."""
    for flags, said in ((["--seed", "-1"], "--seed must be >= 0, got -1"), (["--lr", "-1"], "--lr")):
        assert main(["train", "--model", "llama-tiny", "--steps", "1", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("sltune train: error: ") and said in err and err.count("\n") == 1, err
        assert "step/s" not in err and "0/1" not in err            # no bar was drawn before the refusal


def test_a_torch_checkpoint_as_model_is_one_line_naming_the_flag_and_what_to_give(tmp_path, capsys):
    """Issue #23: `--model trained.pt` said "'utf-8' codec can't decode byte 0x80", naming neither the flag
    nor a fix."""
    import torch

    path = tmp_path / "trained.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    for command in (["train", "--model", str(path), "--steps", "1"], ["profile", "--model", str(path)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"sltune {command[0]}: error: --model {path}: a PyTorch checkpoint (torch.save"), err
        assert "give a preset (llama-tiny, " in err and "a Hugging Face model folder" in err
        assert err.count("\n") == 1 and "utf-8" not in err


def test_a_missing_file_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"sltune train: error: {tmp_path / 'nope.yaml'}: No such file or directory\n"


def test_every_subcommand_is_described_with_its_defaults_and_environment():
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert command.description, f"sltune {name} has no description"
        text = " ".join(command.format_help().split())
        for action in command._actions:
            if action.dest in ("help", "debug"):
                continue
            assert action.help, f"sltune {name} {action.dest} is unexplained"
            if action.default not in (None, False):
                assert f"default: {action.default}" in text, f"sltune {name} {action.dest}: default not shown"
    helps = {name: " ".join(c.format_help().split()) for name, c in sub.choices.items()}
    assert "SLTUNE_API_TOKEN" in helps["submit"] and "SLTUNE_API_TOKEN" in helps["serve"]
    for name in ("serve", "worker"):
        assert "$SLTUNE_DATA_DIR" in helps[name] and "$SLTUNE_DB" in helps[name]
    assert "[--server SERVER | --db DB]" in helps["export"]


def test_the_readme_first_command_trains_from_best_yaml_alone():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert first.endswith("sltune tune examples/tiny-llama-cpu.yaml --out best.yaml && "
                          "sltune train --config best.yaml --steps 20")


def test_plan_s_disk_flags_on_a_best_yaml_are_refused_naming_the_flag(tmp_path, capsys):
    """A best.yaml's plan predicts from its fitted models without disk: --disk-limit and --disk-versions would change
    nothing, so each is refused in one line naming it and the spec to give instead."""
    best = str(tuned_file(tmp_path / "best.yaml"))
    for flag, value in (("--disk-limit", "1TiB"), ("--disk-versions", "1")):
        assert main(["plan", best, flag, value]) == 2
        err = capsys.readouterr().err
        assert err == (f"sltune plan: error: {flag}: {best} is a best.yaml, whose plan predicts from its fitted models "
                       f"without disk; give the tuning spec (sltune plan SPEC.yaml {flag} ...)\n"), err
