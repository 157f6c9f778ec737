"""The first hour with the `sltune` command, as real processes: a tuning job from the command line, training
what it tuned as the README says, and `submit --wait` against a real server."""

import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import optuna
import pytest
import yaml

from sltune.store import Store
from sltune.store.optuna import optuna_location
from tests.support.cli import sltune
from tests.support.specs import tiny_spec


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
