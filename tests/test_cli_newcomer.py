"""The first hour with the `sltune` command: train what was tuned from best.yaml alone, and every mistake
answered in one line naming the field and the fix (a traceback only with --debug)."""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import yaml

from sltune import SpeedLoaderConfig
from sltune.cli.main import main, parser
from sltune.store import Store
from sltune.store.optuna import optuna_location
from tests.conftest import tiny_spec
from tests.cli import sltune


def tuned_file(path):
    """A best.yaml as a job exports it: knobs, then the workload and model it was tuned on."""
    SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2, num_live_blocks=1, dtype="bfloat16").to_yaml(
        path, workload={"mode": "train", "seq_len": 16, "world_size": 1},
        provenance={"job_id": "j", "model": {"preset": "gpt2-tiny", "dtype": "bfloat16"}})
    return path


def test_train_with_only_the_config_trains_the_model_seq_len_and_dtype_it_names(tmp_path):
    out = sltune("train", "--config", str(tuned_file(tmp_path / "best.yaml")), "--steps", "1", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    # what the job tuned, not the defaults (llama-tiny, 128, float32)
    assert (summary["model"], summary["seq_len"], summary["config"]["dtype"]) == ("gpt2-tiny", 16, "bfloat16")


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


def test_a_bad_service_setting_names_the_flag_or_the_variable_it_came_from(capsys, monkeypatch):
    assert main(["serve", "--workers", "0"]) == 2
    assert capsys.readouterr().err == "sltune serve: error: --workers: Input should be greater than or equal to 1\n"
    monkeypatch.setenv("SLTUNE_API_WORKERS", "0")
    assert main(["serve"]) == 2
    assert capsys.readouterr().err == ("sltune serve: error: SLTUNE_API_WORKERS: Input should be greater than or "
                                       "equal to 1\n")


def test_a_bad_value_in_a_flag_built_model_is_one_line_naming_the_field(capsys):
    assert main(["profile", "--device-memory-limit", "lots"]) == 2
    err = capsys.readouterr().err
    assert err == ("sltune profile: error: device_memory_limit: cannot read 'lots' as a byte size; write a number "
                   "of bytes or a number with a unit such as '512MiB', '2GiB' or '8GB'\n")


def test_a_share_of_weights_outside_0_to_1_is_one_line_naming_the_flag(capsys):
    for value in ("2", "-0.5", "nan"):
        assert main(["profile", "--mode", "generate", "--weights-on-device", value]) == 2
        assert capsys.readouterr().err == (f"sltune profile: error: --weights-on-device {float(value):g}: give a "
                                           "share from 0 (no weights kept on the device) to 1 (all of them)\n")


def test_a_bad_knob_flag_names_the_flag_once(capsys):
    """Issue #23: `train --device-memory-limit=-1GiB` said "device_memory_limit: device_memory_limit: cannot
    read ...", naming the field twice and the flag not at all."""
    assert main(["train", "--device-memory-limit=-1GiB", "--steps", "1"]) == 2
    assert capsys.readouterr().err == ("sltune train: error: --device-memory-limit: cannot read '-1GiB' as a byte "
                                       "size; write a number of bytes or a number with a unit such as '512MiB', "
                                       "'2GiB' or '8GB'\n")
    with pytest.raises(ValueError) as err:
        SpeedLoaderConfig.from_dict({"device_memory_limit": "-1GiB"}, source="best.yaml")
    assert str(err.value).startswith("best.yaml: device_memory_limit: cannot read '-1GiB'")
    assert str(err.value).count("device_memory_limit") == 1


def test_a_bad_train_flag_is_refused_before_the_progress_bar_and_names_the_flag(capsys):
    """Issue #23: `train --seed -1` was accepted (and then refused only once the bar had started), `--lr -1`
    gave torch's "Invalid learning rate: -1.0", which names no flag."""
    for flags, said in ((["--seed", "-1"], "--seed must be >= 0, got -1"), (["--lr", "-1"], "--lr")):
        assert main(["train", "--model", "llama-tiny", "--steps", "1", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("sltune train: error: ") and said in err and err.count("\n") == 1, err
        assert "step/s" not in err and "0/1" not in err            # no bar was drawn before the refusal


def test_a_torch_checkpoint_as_model_is_one_line_naming_the_flag_and_what_to_give(tmp_path, capsys):
    """Issue #23: `--model trained.pt` said "'utf-8' codec can't decode byte 0x80", naming neither the flag
    nor a fix."""
    import torch

    path = tmp_path / "trained.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    for command in (["train", "--model", str(path), "--steps", "1"], ["profile", "--model", str(path)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"sltune {command[0]}: error: --model {path}: a PyTorch checkpoint (torch.save"), err
        assert "give a preset (llama-tiny, " in err and "a Hugging Face model folder" in err
        assert err.count("\n") == 1 and "utf-8" not in err


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


def test_the_readme_path_trains_what_was_tuned_and_a_flag_past_the_limit_is_one_line(tuned):
    best = tuned.tmp / "best.yaml"
    out = sltune("train", "--config", str(best), "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert "train llama-tiny s=32" in out.stderr and "trained 2 steps" in out.stdout

    over = sltune("train", "--config", str(best), "--steps", "2", "--seq-len", "512")   # a flag overrides the file
    assert over.returncode == 2 and "Traceback" not in over.stderr
    last = over.stderr.strip().splitlines()[-1]
    assert last.startswith("sltune train: error: device memory limit exceeded")
    assert f"device_memory_limit in {best}" in last and "--device-memory-limit" in last


def test_tune_ends_its_bar_full_and_a_finished_job_has_no_time_left(tuned):
    frames = [f for f in re.split(r"[\r\n]", tuned.out.stderr) if "trial" in f and "|" in f]
    assert "2/2" in frames[-1] and "100%" in frames[-1], frames[-1]      # ran 2 of max 3: all it will run
    assert "left=" not in frames[-1]
    assert Store(tuned.db).job(tuned.job_id).progress["time_left_s"] == 0
    assert f"train with `sltune train --config {tuned.tmp / 'best.yaml'}`" in tuned.out.stdout


def test_optuna_reads_the_study_right(tuned):
    study = optuna.load_study(study_name=f"sltune-{tuned.job_id}", storage=optuna_location(tuned.db)[0])
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


def test_every_subcommand_is_described_with_its_defaults_and_environment():
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert command.description, f"sltune {name} has no description"
        text = " ".join(command.format_help().split())
        for action in command._actions:
            if action.dest in ("help", "debug"):
                continue
            assert action.help, f"sltune {name} {action.dest} is unexplained"
            if action.default not in (None, False):
                assert f"default: {action.default}" in text, f"sltune {name} {action.dest}: default not shown"
    helps = {name: " ".join(c.format_help().split()) for name, c in sub.choices.items()}
    assert "SLTUNE_API_TOKEN" in helps["submit"] and "SLTUNE_API_TOKEN" in helps["serve"]
    for name in ("serve", "worker"):
        assert "$SLTUNE_DATA_DIR" in helps[name] and "$SLTUNE_DB" in helps[name]
    assert "[--server SERVER | --db DB]" in helps["export"]


def test_submit_wait_follows_the_job_and_export_reads_server_or_db(services, tmp_path):
    url = services.serve(worker=False)
    spec = tmp_path / "spec.yaml"
    # each trial times its steps for 2 s: the job runs for seconds on a fast machine too, so the 1 s poll sees it
    spec.write_text(yaml.safe_dump(tiny_spec("newcomer-submit", trials=2, trial_min_time_s=2)))
    submit = subprocess.Popen([sys.executable, "-m", "sltune", "submit", str(spec), "--server", url, "--wait"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=services.env)
    with services.client() as c:           # queued, with no worker yet: the bar says what it waits for
        deadline = time.monotonic() + 60
        while not c.get("/jobs").json() and time.monotonic() < deadline:
            time.sleep(0.2)
    time.sleep(2.5)
    services.worker()
    out, err = submit.communicate(timeout=240)
    assert submit.returncode == 0, err
    job_id = out.strip()
    frames = [f for f in re.split(r"[\r\n]", err) if f.startswith(f"job {job_id} ") and "|" in f]
    assert any("queued, waiting for no live worker" in f for f in frames)
    assert not any("waiting" in f for f in frames if "queued" not in f)        # the label follows the state
    assert any(f.startswith(f"job {job_id} running") for f in frames)
    assert frames[-1].startswith(f"job {job_id} succeeded") and "2/2" in frames[-1] and "left=" not in frames[-1]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"job {job_id} succeeded: [\d,.]+ tokens/s with b=\d+ N=\d+ k=\d+ \(speedloader\)", last)

    for where in (["--server", url], ["--db", services.db]):
        exported = sltune("export", job_id, *where, "--out", str(tmp_path / "best.yaml"))
        assert exported.returncode == 0, exported.stderr
        assert yaml.safe_load((tmp_path / "best.yaml").read_text())["provenance"]["job_id"] == job_id
    missing = sltune("export", "nosuchjob", "--server", url)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "nosuchjob" in missing.stderr


def test_the_readme_first_command_trains_from_best_yaml_alone():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert first.endswith("sltune tune examples/tiny-llama-cpu.yaml --out best.yaml && "
                          "sltune train --config best.yaml --steps 20")
