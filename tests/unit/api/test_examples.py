"""The API's example spec (sltune.api.examples) is examples/tiny-llama-cpu.yaml: read from the checkout, or in a
wheel from its packaged copy, held equal byte for byte."""

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]


def test_the_openapi_example_is_the_example_file_in_a_checkout_and_in_a_wheel():
    from sltune.api import examples

    source = ROOT / "examples" / "tiny-llama-cpu.yaml"
    assert examples.SOURCE == source and examples.TUNE_EXAMPLE == yaml.safe_load(source.read_text())
    # a wheel (the Docker image) has no examples/ folder: it reads the packaged copy, held equal byte for byte
    assert examples.PACKAGED.read_bytes() == source.read_bytes()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(examples.PACKAGED.match(pattern) for pattern in package_data["sltune.api"])
