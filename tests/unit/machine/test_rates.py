"""A machine's rates as stored (sltune.machine.rates): a missing rates file names the command that writes it."""

import pytest

from sltune.machine import MachineRates


def test_a_missing_rates_file_names_the_command_that_writes_it(tmp_path):
    with pytest.raises(ValueError, match="sltune calibrate --out"):
        MachineRates.load(tmp_path / "rates.json")
