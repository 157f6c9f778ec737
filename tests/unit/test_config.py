"""SpeedLoaderConfig: validation messages and the YAML a tuning job exports."""

import pytest
import yaml

from sltune import SpeedLoaderConfig


def test_yaml_round_trip_with_report_sections(tmp_path):
    cfg = SpeedLoaderConfig(sub_batch_size=4, num_sub_batches=8, num_live_blocks=2, device_memory_limit="1GiB")
    path = tmp_path / "best.yaml"
    cfg.to_yaml(path, measured={"tokens_per_s": 123.4}, provenance={"job_id": "abc"})
    data = yaml.safe_load(path.read_text())
    assert data["effective_batch_size"] == 32 and data["measured"]["tokens_per_s"] == 123.4
    assert SpeedLoaderConfig.from_yaml(path) == cfg


def test_from_yaml_names_a_misspelt_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sub_batch_size: 2\nnum_live_block: 3\n")
    with pytest.raises(ValueError, match=r"bad.yaml: num_live_block: unknown field.*num_live_blocks"):
        SpeedLoaderConfig.from_yaml(path)


def test_from_yaml_checks_the_effective_batch(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sub_batch_size: 2\nnum_sub_batches: 4\neffective_batch_size: 16\n")
    with pytest.raises(ValueError, match="effective_batch_size 16 != sub_batch_size"):
        SpeedLoaderConfig.from_yaml(path)


def test_bad_sizes_say_how_to_write_them():
    with pytest.raises(ValueError, match="2GiB"):
        SpeedLoaderConfig(device_memory_limit="two gigs")
    with pytest.raises(ValueError, match="schedule"):
        SpeedLoaderConfig(schedule="zero3")


def test_to_yaml_rejects_unknown_sections():
    with pytest.raises(ValueError, match="unknown sections"):
        SpeedLoaderConfig().to_yaml(extra={"x": 1})


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.5, 0, -3, "0.1B", "inf GiB"])
def test_sizes_must_be_whole_positive_bytes(value):
    with pytest.raises(ValueError, match="device_memory_limit"):
        SpeedLoaderConfig(device_memory_limit=value)


def test_an_empty_api_token_is_no_token():
    from sltune.settings import Settings

    assert Settings(api_token="").api_token is None
