"""A new user's first mistakes, each answered in one line with the fix and exit code 2: a flag that does not
exist or a value a flag cannot read; and generation without transformers' deprecation warnings."""

from __future__ import annotations

import warnings

import pytest
import torch

from sltune.cli.main import main


# -- 2. generation without transformers' deprecation warnings ------------------------------------------------

@pytest.mark.parametrize("preset", ["llama-tiny", "mistral-tiny", "qwen2-tiny", "gpt2-tiny", "opt-tiny"])
def test_engine_generate_emits_no_future_or_deprecation_warning(preset):
    from sltune import SpeedLoaderConfig, SpeedLoaderEngine
    from sltune.models import build

    engine = SpeedLoaderEngine(build(preset), SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=2,
                                                                num_live_blocks=1), optimizer=None)
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, pad_token_id=0)
    assert out.shape == (2, 8)
    loud = [f"{w.category.__name__}: {w.message}" for w in caught
            if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert loud == []


# -- 3. argument errors: one line, against the command given -------------------------------------------------

def argv_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "usage:" not in captured.err, captured.err
    return captured.err


def test_an_unknown_flag_is_reported_against_its_command_with_the_closest_flag(capsys):
    assert argv_error(["train", "--batch-size", "4"], capsys) == (
        "sltune train: error: unrecognized argument --batch-size; did you mean --sub-batch-size?\n")
    assert argv_error(["train", "--batch-size=4", "--steps", "1"], capsys) == (
        "sltune train: error: unrecognized argument --batch-size; did you mean --sub-batch-size?\n")
    # a flag whose name is part of a real one's, though not close enough in spelling for difflib alone
    assert argv_error(["train", "--memory", "2GiB"], capsys) == (
        "sltune train: error: unrecognized argument --memory; did you mean --device-memory-limit?\n")
    assert argv_error(["--debug", "profile", "--live-blocks", "2"], capsys) == (
        "sltune profile: error: unrecognized argument --live-blocks; did you mean --num-live-blocks?\n")
    assert argv_error(["profile", "--new-tokes", "2"], capsys) == (
        "sltune profile: error: unrecognized argument --new-tokes; did you mean --new-tokens?\n")
    # nothing close: no guess, the pointer to the help instead
    assert argv_error(["train", "--foo"], capsys) == (
        "sltune train: error: unrecognized argument --foo; see `sltune train -h`\n")


def test_every_command_reports_an_unknown_flag_as_its_own_in_one_line(capsys):
    import argparse

    from sltune.cli.main import parser

    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    required = {"tune": ["spec.yaml"], "export": ["job"], "submit": ["spec.yaml", "--server", "http://x"],
                "compare": ["a", "b", "--db", "sqlite:///x.db"]}       # argparse asks for these first
    for name in commands:
        err = argv_error([name, *required.get(name, []), "--zzzz-qqqq"], capsys)
        assert err.startswith(f"sltune {name}: error: unrecognized argument --zzzz-qqqq"), err
    assert argv_error(["tune", "spec.yaml", "--zzzz-qqqq", "--wxyz"], capsys) == (
        "sltune tune: error: unrecognized arguments --zzzz-qqqq, --wxyz; see `sltune tune -h`\n")


def test_a_value_a_flag_cannot_read_is_one_line_with_the_pointer_to_help(capsys):
    assert argv_error(["train", "--lr", "3e-4x"], capsys) == (
        "sltune train: error: argument --lr: invalid float value: '3e-4x'; see `sltune train -h`\n")
    assert argv_error(["profile", "--mode", "generate", "--steps", "many"], capsys) == (
        "sltune profile: error: argument --steps: invalid int value: 'many'; see `sltune profile -h`\n")


def test_a_missing_argument_or_command_is_one_line_with_the_pointer_to_help(capsys):
    assert argv_error(["submit"], capsys) == (
        "sltune submit: error: the following arguments are required: spec, --server; see `sltune submit -h`\n")
    err = argv_error([], capsys)
    assert err.startswith("sltune: error: give a command: train, profile, tune, ") and err.endswith(
        "; see `sltune -h`\n"), err
    err = argv_error(["--debug"], capsys)
    assert err.startswith("sltune: error: give a command: "), err
    err = argv_error(["nosuchcommand"], capsys)
    assert err.startswith("sltune: error: argument COMMAND: invalid choice: 'nosuchcommand'") and err.endswith(
        "; see `sltune -h`\n"), err


def test_help_is_still_the_full_help(capsys):
    for argv, shows in ((["-h"], ["usage: sltune [-h] [--debug] COMMAND ...", "train", "compare", "--debug"]),
                        (["train", "-h"], ["usage: sltune train", "--sub-batch-size", "--lr LR", "--config"])):
        with pytest.raises(SystemExit) as done:
            main(argv)
        out = capsys.readouterr().out
        assert done.value.code == 0 and all(s in out for s in shows) and out.count("\n") > 10, out
