"""How far a fit can be trusted, as a newcomer's `sltune tune` process says it: a fit with too few points
for a leave-one-out error says why instead of printing dashes."""

from __future__ import annotations

import pytest
import yaml

from sltune.cli.main import main
from tests.support.cli import sltune


@pytest.fixture(scope="module")
def two_points(tmp_path_factory):
    """A real tuning job of two configs: each model fitted on 2 points for 2 coefficients, too few to leave one
    out."""
    tmp = tmp_path_factory.mktemp("loo")
    spec = {"name": "two", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
            "search": {"strategy": "grid", "sub_batch_size": [1, 2], "num_sub_batches": 1, "num_live_blocks": 1,
                       "max_trials": 2, "trial_steps": 1, "trial_min_time_s": 0, "confirm_rounds": 0,
                       "profile": False}}
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = sltune("tune", str(tmp / "spec.yaml"), "--db", f"sqlite:///{tmp / 'jobs.db'}", "--out",
                 str(tmp / "best.yaml"), env={"SLTUNE_DATA_DIR": str(tmp / "data")}, process=True)
    assert out.returncode == 0, out.stderr
    return tmp, out.stdout


def test_tune_says_why_a_model_has_no_leave_one_out_error(two_points):
    _, stdout = two_points
    models = [line for line in stdout.splitlines() if line.startswith("  model ")]
    assert len(models) == 3, stdout
    for line in models:
        assert "- typical" not in line and "- max" not in line, line
        assert line.endswith("no leave-one-out error: too few points for a leave-one-out fit: 2 points for 2 "
                             "coefficients: has a leave-one-out error after 1 more (3 in all)"), line


def test_plan_of_a_best_yaml_says_why_its_models_have_no_leave_one_out_error(two_points, capsys):
    tmp, _ = two_points
    assert main(["plan", str(tmp / "best.yaml")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "leave-one-out" in x)
    assert "- typical" not in line and "- max" not in line, line
    assert line.endswith("none for device, host and throughput: too few points for a leave-one-out fit: 2 "
                         "points for 2 coefficients: has a leave-one-out error after 1 more (3 in all)"), line
    assert "expect errors near the leave-one-out figures" not in out
    assert "the models have no leave-one-out error: their errors are unknown" in out
