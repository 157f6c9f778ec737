"""One formatter says every validation error (sltune.field_errors): the field's path, then why, on one line, the same
for a config, a spec, the optimizer section, the CLI's flags and the API."""

import pytest

from sltune.cli.main import main
from sltune.config import SpeedLoaderConfig
from sltune.field_errors import one_line
from sltune.profiling.schema import TrialSpec
from sltune.training.optimizer import OptimizerConfig
from sltune.tuning.spec import TuningSpec

SPEC = {"name": "t", "model": {"preset": "llama-tiny"}}


def test_the_same_mistake_reads_the_same_in_a_config_a_spec_a_trial_and_the_optimizer_section():
    """A bound of pydantic's, said by each reader through the one formatter: the field, then the same reason."""
    with pytest.raises(ValueError) as config:
        SpeedLoaderConfig.from_dict({"sub_batch_size": 0}, source="best.yaml")
    with pytest.raises(ValueError) as trial:
        TrialSpec(sub_batch_size=0)
    with pytest.raises(ValueError) as spec:
        TuningSpec.parse({**SPEC, "hardware": {"world_size": 0}})
    with pytest.raises(ValueError) as optimizer:
        OptimizerConfig.from_dict({"lr": -1}, source="optimizer")
    assert str(config.value) == "best.yaml: sub_batch_size: Input should be greater than or equal to 1"
    assert one_line(trial.value) == "sub_batch_size: Input should be greater than or equal to 1"
    assert str(spec.value) == "spec: hardware.world_size: Input should be greater than or equal to 1"
    assert str(optimizer.value).startswith("optimizer.lr: ")


def test_a_union_s_members_and_pydantic_s_prefixes_stay_out_of_the_line():
    """search.sub_batch_size takes a number, a list or a range: the range's own field is named, not the union
    member pydantic tried ('Range'), and a validator's 'Value error, ' is dropped."""
    with pytest.raises(ValueError) as err:
        TuningSpec.parse({**SPEC, "search": {"sub_batch_size": {"min": 0, "max": 2}}})
    line = str(err.value)
    assert line.startswith("spec: search.sub_batch_size") and "Range" not in line and "Value error" not in line
    with pytest.raises(ValueError, match=r"^spec: serach: unknown field; check its spelling against the spec "
                                         r"reference \(docs/reference/spec\.md\)$"):
        TuningSpec.parse({**SPEC, "serach": {}})
    with pytest.raises(ValueError, match=r"^best\.yaml: sub_batch: unknown field; check the spelling \(fields: "):
        SpeedLoaderConfig.from_dict({"sub_batch": 1}, source="best.yaml")


def test_the_cli_says_one_rule_with_its_flags_and_the_library_with_its_fields(tmp_path, capsys):
    """param_offload disk needs optimizer_offload disk: one rule, one wording; the CLI names its flags."""
    with pytest.raises(ValueError) as err:
        TrialSpec(param_offload="disk", offload_dir=str(tmp_path))
    field_wording = one_line(err.value)
    assert field_wording == ("param_offload disk: training steps each unit's weights file with its optimizer block; "
                             "add optimizer_offload disk")
    assert main(["profile", "--param-offload", "disk", "--offload-dir", str(tmp_path)]) == 2
    flags_wording = capsys.readouterr().err.strip().removeprefix("sltune profile: error: ")
    assert flags_wording == field_wording.replace("param_offload", "--param-offload").replace(
        "optimizer_offload", "--optimizer-offload")
