"""`sltune` (sltune.cli.main): a new user's first mistakes, each answered in one line with the fix and exit code 2
(a flag that does not exist, a value a flag cannot read, a missing argument, command or file, a malformed YAML; a
traceback only with --debug); every command described with its defaults and environment; -h the full help."""

from __future__ import annotations

import argparse

import pytest

from sltune.cli.main import main, parser


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
