"""A finished job's answer (sltune.tuning.report.result): best.yaml carries the weights on disk and names no
folder."""

from __future__ import annotations

from sltune.config import SpeedLoaderConfig
from sltune.tuning.report.result import best_config
from tests.support.offload_specs import BOTH, OPTIMIZER, WEIGHTS, spec


def test_best_yaml_carries_the_weights_on_disk_and_names_no_folder(tmp_path):
    s = spec(BOTH)
    result = {"best": {"config": {**WEIGHTS.knobs(), "schedule": "speedloader"}}}
    cfg = best_config(s, result)
    assert (cfg.param_offload, cfg.optimizer_offload, cfg.offload_dir) == ("disk", "disk", None)
    assert best_config(s, result, offload_dir=str(tmp_path)).offload_dir == str(tmp_path)
    path = tmp_path / "best.yaml"
    best_config(s, result, offload_dir=str(tmp_path)).to_yaml(path)
    assert SpeedLoaderConfig.from_yaml(path).param_offload == "disk"      # what `sltune train --config` reads
    host = best_config(s, {"best": {"config": {**OPTIMIZER.knobs(), "schedule": "speedloader"}}})
    assert host.param_offload == "host" and host.optimizer_offload == "disk"
