"""`sltune serve` (sltune.cli.service): a bad setting names the flag or the environment variable it came from."""

from sltune.cli.main import main


def test_a_bad_service_setting_names_the_flag_or_the_variable_it_came_from(capsys, monkeypatch):
    assert main(["serve", "--workers", "0"]) == 2
    assert capsys.readouterr().err == "sltune serve: error: --workers: Input should be greater than or equal to 1\n"
    monkeypatch.setenv("SLTUNE_API_WORKERS", "0")
    assert main(["serve"]) == 2
    assert capsys.readouterr().err == ("sltune serve: error: SLTUNE_API_WORKERS: Input should be greater than or "
                                       "equal to 1\n")
