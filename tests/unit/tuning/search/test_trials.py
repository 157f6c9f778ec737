"""What one trial of a job runs (sltune.tuning.search.trials): the weights on disk in the runner's offload
folder."""

from __future__ import annotations

import pytest

from sltune.tuning.search.trials import trial_spec
from sltune.tuning.space import Candidate
from tests.support.offload_specs import BOTH, OPTIMIZER, WEIGHTS, spec


def test_a_trial_of_the_weights_on_disk_runs_them_there_in_the_runners_folder(tmp_path):
    s = spec(BOTH)
    trial = trial_spec(s, WEIGHTS, None, offload_dir=tmp_path)
    assert (trial.param_offload, trial.optimizer_offload, trial.offload_dir) == ("disk", "disk", str(tmp_path))
    assert trial.knobs()["param_offload"] == "disk"
    assert Candidate.from_knobs(trial.knobs()) == WEIGHTS          # what a stored trial reads back
    assert WEIGHTS.knobs()["param_offload"] == "disk" and "param_offload" not in OPTIMIZER.knobs()
    assert str(WEIGHTS) == "b=1 N=1 k=1 optimizer_offload=disk param_offload=disk"
    assert trial_spec(s, OPTIMIZER, None, offload_dir=tmp_path).param_offload == "host"
    with pytest.raises(ValueError, match="param_offload disk needs the runner's offload folder"):
        trial_spec(s, WEIGHTS, None)
    gen = spec({"param_offload": "disk", "num_sub_batches": [1]}, workload={"mode": "generate"})
    alone = Candidate(1, 1, 1, kv_cache="host", weights_on_device=0.0, param_offload="disk")
    trial = trial_spec(gen, alone, None, offload_dir=tmp_path)
    assert (trial.param_offload, trial.optimizer_offload, trial.mode) == ("disk", "host", "generate")
