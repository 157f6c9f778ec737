"""The flags several commands share (sltune.cli.common): a bad knob flag and a --model that is no model are each one
line naming the flag."""

import pytest

from sltune import SpeedLoaderConfig
from sltune.cli.main import main


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
