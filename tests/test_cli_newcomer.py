"""The first hour with the `sltune` command: train what was tuned from best.yaml alone, and every mistake
answered in one line naming the field and the fix (a traceback only with --debug)."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import optuna
import pytest
import yaml

from sltune import SpeedLoaderConfig
from sltune.cli.main import main
from sltune.store import Store


def sltune(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "sltune", *args], capture_output=True, text=True, timeout=timeout)


def tuned_file(path, device_memory_limit=None):
    """A best.yaml as a job exports it: knobs, then the workload and model it was tuned on."""
    SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2, num_live_blocks=1, dtype="bfloat16",
                      device_memory_limit=device_memory_limit).to_yaml(
        path, workload={"mode": "train", "seq_len": 16, "world_size": 1},
        provenance={"job_id": "j", "model": {"preset": "gpt2-tiny", "dtype": "bfloat16"}})
    return path


def test_train_with_only_the_config_trains_what_was_tuned(tmp_path):
    probe = sltune("train", "--config", str(tuned_file(tmp_path / "probe.yaml")), "--steps", "1", "--json")
    assert probe.returncode == 0, probe.stderr
    measured = json.loads(probe.stdout)
    # the model, seq_len and dtype the job tuned, not the defaults (llama-tiny, 128, float32)
    assert (measured["model"], measured["seq_len"], measured["config"]["dtype"]) == ("gpt2-tiny", 16, "bfloat16")

    # a limit the tuned seq_len fits under, which 128 tokens per row would cross
    best = tuned_file(tmp_path / "best.yaml", device_memory_limit=int(measured["peak_device_bytes"] * 1.5))
    out = sltune("train", "--config", str(best), "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert "train gpt2-tiny s=16" in out.stderr and "trained 2 steps" in out.stdout

    over = sltune("train", "--config", str(best), "--steps", "2", "--seq-len", "128")   # a flag overrides the file
    assert over.returncode == 2
    last = over.stderr.strip().splitlines()[-1]
    assert "Traceback" not in over.stderr
    assert last.startswith("sltune train: error: device memory limit exceeded")
    assert f"device_memory_limit in {best}" in last and "--device-memory-limit" in last


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


def test_a_bad_flag_value_names_the_flag_not_the_file(tmp_path, capsys):
    assert main(["plan", "--from", str(tuned_file(tmp_path / "best.yaml")), "--device-memory-limit", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sltune plan: error: --device-memory-limit: cannot read 'lots' as a byte size; write")
    assert "best.yaml" not in err and err.count("device_memory_limit") == 0


def test_a_missing_file_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"sltune train: error: {tmp_path / 'nope.yaml'}: No such file or directory\n"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One real tuning job from the command line: a grid of two configs, one of which runs out of memory,
    under max_trials 3, so the job stops before its max."""
    tmp = tmp_path_factory.mktemp("tuned")
    spec = {"name": "newcomer", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
            "hardware": {"device_memory_limit": "3MiB"},
            "search": {"strategy": "grid", "sub_batch_size": [1, 32], "num_sub_batches": 1, "num_live_blocks": 1,
                       "max_trials": 3, "trial_steps": 1}}
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    db = f"sqlite:///{tmp / 'jobs.db'}"
    out = subprocess.run([sys.executable, "-m", "sltune", "tune", str(tmp / "spec.yaml"), "--db", db, "--out",
                          str(tmp / "best.yaml")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SLTUNE_DATA_DIR": str(tmp / "data")})
    assert out.returncode == 0, out.stderr
    job_id = Store(db).jobs()[0].id
    return SimpleNamespace(tmp=tmp, db=db, out=out, job_id=job_id)


def test_tune_ends_its_bar_full_and_a_finished_job_has_no_time_left(tuned):
    frames = [f for f in re.split(r"[\r\n]", tuned.out.stderr) if "trial" in f and "|" in f]
    assert "2/2" in frames[-1] and "100%" in frames[-1], frames[-1]      # ran 2 of max 3: all it will run
    assert "left=" not in frames[-1]
    assert Store(tuned.db).job(tuned.job_id).progress["time_left_s"] == 0
    assert f"train with `sltune train --config {tuned.tmp / 'best.yaml'}`" in tuned.out.stdout


def test_optuna_reads_the_study_right(tuned):
    study = optuna.load_study(study_name=f"sltune-{tuned.job_id}", storage=tuned.db)
    assert study.metric_names == ["tokens_per_s"]
    by_b = {t.params["sub_batch_size"]: t for t in study.trials}
    ok, oom = by_b[1], by_b[32]
    assert ok.state == optuna.trial.TrialState.COMPLETE and ok.value > 0
    assert ok.user_attrs["role"] == "grid" and ok.user_attrs["status"] == "ok"
    assert ok.user_attrs["peak_device_bytes"] > 0 and ok.user_attrs["peak_host_bytes"] > 0
    assert abs(sum(ok.user_attrs["breakdown"].values()) - 1) < 1e-6
    assert oom.state == optuna.trial.TrialState.FAIL and oom.value is None
    assert oom.user_attrs["status"] == "oom" and "device memory limit exceeded" in oom.user_attrs["reason"]
    stored = {t.number: t.tokens_per_s for t in Store(tuned.db).trials(tuned.job_id)}
    assert stored[ok.user_attrs["sltune_trial"]] == ok.value
