"""A model's fields as flags (sltune.cli.flags): a bad value in a flag-built model is one line naming the flag, not
the field."""

from sltune.cli.main import main


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
