"""Tuning jobs end to end: real trials in real processes, a real SQLite store, the Optuna study beside it."""

import json
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
import yaml

from sltune import SpeedLoaderConfig
from sltune.profiling import run_trial
from sltune.settings import Settings
from sltune.store import Store
from sltune.tuning.report.plan_from_fits import plan
from sltune.tuning.report.result import export_yaml
from sltune.service.local import tune
from sltune.tuning.search.study import optuna_storage
from sltune.tuning.search.trials import trial_spec
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.search.state import SearchState
from sltune.tuning.search.fit import LinearFit
from tests.support.specs import admitted_spec
from tests.support.cli import sltune

LIMIT = 4 * 2**20
SPEC = {
    "name": "tiny", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 64},
    "hardware": {"device_memory_limit": LIMIT},
    "search": {"sub_batch_size": {"min": 1, "max": 16}, "num_sub_batches": {"min": 1, "max": 8},
               "num_live_blocks": {"min": 1, "max": 4}, "max_trials": 12, "trial_steps": 1, "trial_min_time_s": 0.3,
               "confirm_rounds": 2,
               "profile": False},
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    data = tmp_path_factory.mktemp("oneshot")
    db = f"sqlite:///{data / 'jobs.db'}"
    calls = []
    result = tune(SPEC, db, progress=calls.append, settings=Settings(data_dir=data))
    return {"result": result, "db": db, "calls": calls, "spec": admitted_spec(SPEC), "dir": data}


def test_oneshot_finds_a_config_that_fits_in_a_fraction_of_the_space(job):
    r = job["result"]
    assert r["status"] == "succeeded", r["error"]
    # the search keeps to its budget, a fraction of the space; the confirmation re-runs two of its configs
    # (how many rounds it needs depends on the machine's noise, so it is not counted against the budget)
    searched = [t for t in r["trials"] if t["role"] != "confirm"]
    assert len(searched) <= SPEC["search"]["max_trials"] < r["space_size"] / 4
    # on this model the largest configs that fit are the fastest, so the pick sits at the device limit; beside
    # another process a smaller config can measure faster, and then no limit binds the pick
    assert r["binding_limit"] in ("device", "none")
    assert r["best"]["peak_device_bytes"] <= admitted_spec(SPEC).hardware.device_memory_limit
    roles = [t["role"] for t in r["trials"]]
    # after the probes it either spends trials on the frontier or stops because no untried config is predicted
    # to beat the best by more than the best's measured noise (issue #10: the tuner does not act on noise)
    assert roles[0] == "probe", r["trials"]
    assert "frontier" in roles or "measured noise" in r["stop_reason"], (r["stop_reason"], r["trials"])
    c = r["best"]["config"]
    assert r["best"]["peak_device_bytes"] <= LIMIT
    # re-run the chosen config under the same limit: it fits
    again = run_trial(trial_spec(job["spec"], Candidate(c["sub_batch_size"], c["num_sub_batches"],
                                                        c["num_live_blocks"]), None))
    assert again.status == "ok" and again.peak_device_bytes <= LIMIT
    # nothing predicted over the limit was ever run except as a probe
    for t in r["trials"]:
        if t["role"] == "frontier":
            assert t["status"] == "ok", t


def test_the_confirmation_round_remeasures_the_finalists_interleaved_and_says_how_sure(tmp_path):
    """A job whose search has measured two configs with overlapping intervals (recorded here, so the overlap
    is certain) resumes, finds nothing left to search, and re-measures both, interleaved, as real trials."""
    import numpy as np

    from sltune.tuning.runner import requirements

    spec = admitted_spec({**SPEC, "name": "confirm", "search": {
     **SPEC["search"], "strategy": "grid", "sub_batch_size": [1, 2], "num_sub_batches": [1],
     "num_live_blocks": [1], "trial_steps": 2, "confirm_rounds": 2}})
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    store = Store(db)
    job = store.create_job(spec.name, spec.model_dump(mode="json"), spec.digest(), requirements(spec))
    rng = np.random.default_rng(0)
    for number, (b, tps) in enumerate([(1, 1000.0), (2, 1010.0)]):
        steps = (b * 64 / tps * rng.lognormal(0, 0.05, 20)).tolist()
        med = float(np.median(steps))
        config = {"sub_batch_size": b, "num_sub_batches": 1, "num_live_blocks": 1, "schedule": "speedloader"}
        store.start_trial(job.id, number, "grid", config, {}, None, None)
        store.finish_trial(job.id, number, {
            "status": "ok", "config": {**config, "seq_len": 64, "world_size": 1}, "tokens_per_s": b * 64 / med,
            "step_seconds": med, "peak_device_bytes": 10**6 * b, "peak_host_bytes": 10**8,
            "timing": {"steps_s": steps, "median_s": med, "tokens_per_s_ci95": [0.9 * tps, 1.1 * tps], "cv": 0.05,
                       "unstable": False, "interference": {}}})
    r = tune(spec, db, settings=Settings(data_dir=tmp_path))
    assert r["job_id"] == job.id and r["status"] == "succeeded", r
    conf = r["confirmation"]
    finalists = [f["config"] for f in conf["finalists"]]
    knobs = {"num_sub_batches": 1, "num_live_blocks": 1, "activations": "recompute"}
    assert finalists == [{"sub_batch_size": 2, **knobs}, {"sub_batch_size": 1, **knobs}]    # the best first
    confirms = [t for t in r["trials"] if t["role"] == "confirm"]
    # A B A B, or A B alone when the first round already settled it (the best >= 1.10x at the interval's low end)
    from sltune.tuning.search.confirm import DECISIVE
    assert conf["rounds"] == 2 or (conf["rounds"] == 1 and conf["ci95"][0] > DECISIVE), conf
    assert [t["config"] for t in confirms] == finalists * conf["rounds"]
    assert [t["number"] for t in confirms] == list(range(2, 2 + 2 * conf["rounds"]))
    assert all(t["status"] == "ok" for t in confirms)
    rows = [t for t in store.trials(job.id) if t.role == "confirm"]
    assert len(rows) == 2 * conf["rounds"] and all(t.optuna_number is None and t.result["timing"]["steps_s"]
                                                   for t in rows)
    w, lo, hi = conf["winner"], *conf["ci95"]
    assert conf["winner"] in finalists and conf["runner_up"] in finalists and conf["winner"] != conf["runner_up"]
    assert lo <= conf["ratio"] <= hi and conf["ratio"] >= 1.0 - 1e-12
    assert {k: r["best"]["config"][k] for k in w} == w                                    # the winner is the best
    assert r["confidence"].startswith(f"b={w['sub_batch_size']} N={w['num_sub_batches']} k={w['num_live_blocks']}: "
                                      f"{conf['ratio']:.2f}x [{lo:.2f}, {hi:.2f}] the runner-up")
    # the job's API view and the CLI say the same
    from sltune.cli.tune import describe

    assert f"confidence: {r['confidence']}" in describe(r)


def test_progress_reports_trials_best_and_time_left(job):
    calls = job["calls"]
    done = [c["trials_done"] for c in calls]
    searched = [t for t in job["result"]["trials"] if t["role"] != "confirm"]     # of max_trials; confirms apart
    assert done == sorted(done) and done[-1] == len(searched)
    assert calls[-1]["best_tokens_per_s"] == job["result"]["best"]["tokens_per_s"]
    assert all("time_left_s" in c and c["max_trials"] == 12 for c in calls)


def test_fitted_models_predict_held_out_peaks_within_ten_percent(job):
    spec = job["spec"]
    shape = shape_of("llama-tiny")
    # the host model corrects the prior, whose process term is the job's own measurement
    state = SearchState(spec, shape, SearchSpace(spec, shape), baseline=job["result"]["trial_baseline_bytes"])
    state.fits = {k: LinearFit.from_dict(v) for k, v in job["result"]["models"].items()}
    tried = {Candidate(t["config"]["sub_batch_size"], t["config"]["num_sub_batches"], t["config"]["num_live_blocks"])
             for t in job["result"]["trials"]}
    held_out = [c for c in state.space.candidates if c not in tried and state.predict(c).fits
                and not any(f.extrapolated(state.vars(c)) for f in state.fits.values())]
    assert len(held_out) >= 6
    picks = held_out[::2]
    worst = 0.0
    for c in picks:
        measured = run_trial(trial_spec(spec, c, None))
        assert measured.status == "ok", measured.error
        pred = state.predict(c)
        for p, m in ((pred.device, measured.peak_device_bytes), (pred.host, measured.peak_host_bytes)):
            worst = max(worst, abs(p - m) / m)
    print(f"worst held-out peak prediction error: {worst:.1%}")
    assert worst <= 0.10


def test_exported_yaml_round_trips_and_trains(job, tmp_path):
    out = tmp_path / "best.yaml"
    cli = sltune("export", job["result"]["job_id"], "--db", job["db"], "--out", str(out))
    assert cli.returncode == 0, cli.stderr
    cfg = SpeedLoaderConfig.from_yaml(out)
    best = job["result"]["best"]["config"]
    assert (cfg.sub_batch_size, cfg.num_sub_batches, cfg.num_live_blocks) == (
        best["sub_batch_size"], best["num_sub_batches"], best["num_live_blocks"])
    assert cfg.device_memory_limit == LIMIT
    doc = yaml.safe_load(out.read_text())
    assert doc["measured"]["tokens_per_s"] == job["result"]["best"]["tokens_per_s"]
    assert doc["provenance"]["job_id"] == job["result"]["job_id"] and \
        doc["binding_limit"] == job["result"]["binding_limit"]
    assert doc["confidence"] == job["result"]["confidence"] and "the runner-up" in doc["confidence"]
    assert set(doc["resource_models"]) == {"device", "host", "throughput"}
    assert SpeedLoaderConfig.from_yaml(out).to_yaml() == cfg.to_yaml()
    train = sltune("train", "--config", str(out), "--model", "llama-tiny", "--seq-len", "64", "--steps", "2", "--json")
    assert train.returncode == 0, train.stderr
    assert json.loads(train.stdout)["config"]["num_sub_batches"] == best["num_sub_batches"]


def test_plan_predicts_under_other_limits_and_flags_extrapolation(job, tmp_path):
    path = tmp_path / "best.yaml"
    export_yaml(job["spec"], job["result"], path)
    tight = plan(path, device_memory_limit=LIMIT)
    roomy = plan(path, device_memory_limit="64MiB")
    assert roomy["fitting"] > tight["fitting"] > 0
    assert all(c["predicted"]["peak_device_bytes"] * 1.05 <= LIMIT for c in tight["configs"])
    assert roomy["best"]["predicted"]["tokens_per_s"] >= tight["best"]["predicted"]["tokens_per_s"]
    # a config past the largest b the trials measured is flagged as extrapolating b. Which b the search reached
    # depends on the machine: beside other work it may measure the space's largest that fits, and then none lies
    # beyond it (CI, 2026-11-29)
    measured_b = max(t["config"]["sub_batch_size"] for t in job["result"]["trials"] if t["status"] == "ok")
    beyond = [c for c in roomy["configs"] if c["config"]["sub_batch_size"] > measured_b]
    assert all("b" in c["extrapolated"] for c in beyond)
    assert beyond or measured_b == max(c["config"]["sub_batch_size"] for c in roomy["configs"])
    inside = [c for c in tight["configs"] if not c["extrapolated"]]
    assert inside, "some configs under the tuned limit lie inside the measured range"
    with pytest.raises(ValueError, match="device_memory_limit .* below"):
        plan(path, device_memory_limit=1000)
    cli = sltune("plan", "--from", str(path), "--device-memory-limit", "64MiB")
    assert cli.returncode == 0 and "predicted" in cli.stdout and "confidence" in cli.stdout


def test_plan_lists_what_it_cannot_predict_and_prints_its_errors(job, tmp_path):
    path = tmp_path / "best.yaml"
    export_yaml(job["spec"], job["result"], path)
    roomy = plan(path, device_memory_limit="64MiB")
    measured = {(t["config"]["sub_batch_size"], t["config"]["num_sub_batches"], t["config"]["num_live_blocks"])
                for t in job["result"]["trials"] if t["status"] == "ok"}
    assert {(c["config"]["sub_batch_size"], c["config"]["num_sub_batches"], c["config"]["num_live_blocks"])
            for c in roomy["configs"] if c["measured"]} <= measured

    def key(k):
        return int(k.get("sub_batch_size", k.get("b"))), int(k.get("num_sub_batches", k.get("N"))), \
            int(k.get("num_live_blocks", k.get("k")))
    best = key(roomy["best"]["config"])
    assert roomy["best"]["measured"] == (best in measured)
    # by construction, whatever the job happened to measure: a best none of the fits' points is at is flagged
    doc = yaml.safe_load(path.read_text())
    for fit in doc["resource_models"].values():
        fit["residuals"] = [r for r in fit["residuals"] if key(r["vars"]) != best]
    path.write_text(yaml.safe_dump(doc))
    unseen = plan(path, device_memory_limit="64MiB")
    assert key(unseen["best"]["config"]) == best and unseen["best"]["measured"] is False
    assert "never measured" in unseen["confidence"]["summary"]
    # a throughput model that predicts negative step times for larger configs: listed, not dropped
    doc = yaml.safe_load(path.read_text())
    t = doc["resource_models"]["throughput"]
    t["coef"] = [0.05] + [0.0] * (len(t["coef"]) - 1)
    t["coef"][t["features"].index("N")] = -0.02
    path.write_text(yaml.safe_dump(doc))
    r = plan(path, device_memory_limit="64MiB")
    assert r["unpredictable"] and all(u["config"]["num_sub_batches"] >= 4 for u in r["unpredictable"])
    assert r["fitting"] == len(r["configs"]) + len(r["unpredictable"])
    assert all("<= 0" in u["reason"] for u in r["unpredictable"])
    cli = sltune("plan", "--from", str(path), "--device-memory-limit", "64MiB")
    assert cli.returncode == 0, cli.stderr
    assert "leave-one-out errors of the models: device" in cli.stdout and "typical" in cli.stdout
    assert f"{len(r['unpredictable'])} fitting configs have no throughput prediction" in cli.stdout
    assert "predicted step time" in cli.stdout and "[never measured]" in cli.stdout


def test_a_killed_job_resumes_without_rerunning_finished_trials(tmp_path):
    spec = {**SPEC, "name": "resume", "search": {**SPEC["search"], "strategy": "grid", "max_trials": 50,
                                                 "confirm_rounds": 0, "sub_batch_size": [1, 2],
                                                 "num_sub_batches": [1, 2], "num_live_blocks": [1, 4]}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    cmd = [sys.executable, "-m", "sltune", "tune", str(path), "--db", db, "--json"]
    env = {**os.environ, "SLTUNE_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    store = None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        time.sleep(0.3)
        if (tmp_path / "jobs.db").exists():
            store = store or Store(db)
            jobs = store.jobs()
            if jobs and sum(t.status == "ok" for t in store.trials(jobs[0].id)) >= 3:
                break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    job_id = store.jobs()[0].id
    before = {t.number: (t.config, t.status, t.tokens_per_s) for t in store.trials(job_id) if t.status == "ok"}
    assert len(before) >= 3

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)
    assert result["job_id"] == job_id and result["status"] == "succeeded"
    trials = store.trials(job_id)
    for number, row in before.items():
        t = next(t for t in trials if t.number == number)
        assert (t.config, t.status, t.tokens_per_s) == row            # kept, unchanged
    finished = [t for t in trials if t.status != "interrupted"]
    configs = [json.dumps(t.config, sort_keys=True) for t in finished]
    assert len(configs) == len(set(configs)) == 8                        # each config ran exactly once
    study = optuna.load_study(study_name=f"sltune-{job_id}", storage=optuna_storage(db))
    told = [t for t in study.trials if "sltune_trial" in t.user_attrs]      # every finished trial, told once
    assert sorted(t.user_attrs["sltune_trial"] for t in told) == sorted(t.number for t in finished)


@pytest.mark.parametrize("strategy", ["random", "tpe"])
def test_baselines_run_through_optuna_in_the_job_database(strategy, tmp_path):
    spec = {**SPEC, "name": strategy, "search": {**SPEC["search"], "strategy": strategy, "max_trials": 4,
                                               "confirm_rounds": 0}}
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    result = tune(spec, db, settings=Settings(data_dir=tmp_path))
    assert result["strategy"] == strategy and len(result["trials"]) == 4
    assert result["status"] == "succeeded", result["error"]
    study = optuna.load_study(study_name=f"sltune-{result['job_id']}", storage=optuna_storage(db))
    ran = [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)]
    assert len(ran) == 4
    assert {tuple(sorted(t.params.items())) for t in ran} == {
        tuple(sorted({"sub_batch_size": t["config"]["sub_batch_size"],
                      "num_sub_batches": t["config"]["num_sub_batches"],
                      "num_live_blocks": t["config"]["num_live_blocks"]}.items())) for t in result["trials"]}


def test_a_generation_tuning_job_sweeps_kv_cache_and_weights_on_device_and_exports_them(tmp_path):
    spec = {"name": "gen", "model": {"preset": "llama-tiny"},
            "workload": {"mode": "generate", "prompt_len": 16, "new_tokens": 8},
            "hardware": {"device_memory_limit": "2MiB"},
            "search": {"sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2], "num_live_blocks": [1, 2],
                       "weights_on_device": [0.0, 1.0], "max_trials": 8, "trial_steps": 1, "trial_min_time_s": 0,
                       "confirm_rounds": 0, "profile": False}}
    result = tune(spec, f"sqlite:///{tmp_path / 'jobs.db'}", settings=Settings(data_dir=tmp_path))
    assert result["status"] == "succeeded", result
    assert set(result["models"]) == {"device", "host", "throughput"}
    assert result["models"]["host"]["features"] == ["1", "B*s"]         # the KV cache of every sub-batch
    assert result["search_space"]["kv_cache"] == ["host", "device"]
    assert result["search_space"]["weights_on_device"] == [0.0, 1.0]
    ok = [t["config"] for t in result["trials"] if t["status"] == "ok"]
    assert {c["kv_cache"] for c in ok} == {"host", "device"}, result["trials"]
    assert {c["weights_on_device"] for c in ok} == {0.0, 1.0}, result["trials"]
    assert "D*B*s" in result["models"]["device"]["features"]              # device-resident caches
    assert "W" in result["models"]["device"]["features"]                  # and weights
    path = tmp_path / "best.yaml"
    export_yaml(admitted_spec(spec), result, path)
    best = result["best"]["config"]
    assert yaml.safe_load(path.read_text())["weights_on_device"] == best["weights_on_device"]
    cfg = SpeedLoaderConfig.from_yaml(path)
    assert (cfg.sub_batch_size, cfg.kv_cache, cfg.weights_on_device) == (
        best["sub_batch_size"], best["kv_cache"], best["weights_on_device"])
    assert plan(path)["candidates"] == 3 * 2 * 2 * 2 * 2              # b, N, k, kv_cache, weights_on_device
    assert yaml.safe_load(path.read_text())["workload"]["mode"] == "generate"


def test_a_spec_sweeping_activations_runs_both_and_exports_the_winner(tmp_path):
    """search.activations: [recompute, offload] is a knob like the others: both run as real trials, the fits
    gain the offload terms, and best.yaml carries the value that won, which the runtime then reads."""
    spec = {"name": "acts", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 16},
            "search": {"strategy": "grid", "sub_batch_size": [2], "num_sub_batches": [1, 2], "num_live_blocks": [1],
                       "activations": ["recompute", "offload"], "max_trials": 4, "trial_steps": 1,
                       "trial_min_time_s": 0, "confirm_rounds": 0, "profile": False}}
    result = tune(spec, f"sqlite:///{tmp_path / 'jobs.db'}", settings=Settings(data_dir=tmp_path))
    assert result["status"] == "succeeded", result
    assert sorted((t["config"]["activations"], t["config"]["num_sub_batches"]) for t in result["trials"]
                  if t["status"] == "ok") == [("offload", 1), ("offload", 2), ("recompute", 1), ("recompute", 2)]
    assert "[off]*(L-k)*B*s" in result["models"]["host"]["features"]
    assert result["search_space"]["activations"] == ["recompute", "offload"]
    path = tmp_path / "best.yaml"
    export_yaml(admitted_spec(spec), result, path)
    cfg = SpeedLoaderConfig.from_yaml(path)
    assert cfg.activations == result["best"]["config"]["activations"] == yaml.safe_load(path.read_text())["activations"]



def test_time_left_counts_the_confirmation_rounds_at_the_finalists_own_trial_times(tmp_path, monkeypatch):
    """Issue #23: the confirmation round showed 6-8 s left while 25 s ran (its finalists are the slow, large
    configs; the estimate was the search's average over quick probes). Here the trials' times are set: a quick
    probe (b=1) and two slow finalists whose figures tie (b=2, b=4, so all 2 x 2 confirm trials run). From the
    last search trial on, every estimate is held to the time that did remain."""
    import sltune.executors.local as local
    from tests.support.fake_trials import FakeTrials

    monkeypatch.setattr(local, "run_trial", FakeTrials({1: 500.0, 2: 1000.0, 4: 1000.0},
                                                        wall={1: 0.01, 2: 0.5, 4: 0.5}))
    spec = {**SPEC, "name": "time-left", "search": {**SPEC["search"], "strategy": "grid", "sub_batch_size": [1, 2, 4],
                                                    "num_sub_batches": [1], "num_live_blocks": [1], "max_trials": 3,
                                                    "confirm_rounds": 2}}
    calls = []
    r = tune(spec, f"sqlite:///{tmp_path / 'jobs.db'}", progress=calls.append, settings=Settings(data_dir=tmp_path))
    assert r["status"] == "succeeded" and sum(t["role"] == "confirm" for t in r["trials"]) == 4, r["trials"]
    end = calls[-1]["elapsed_s"]
    after = [c for c in calls if c["trials_done"] == 3 and c["phase"] != "finished"
             and (c["last_trial"] or {}).get("status") != "running"]      # after the last search trial, each trial
    assert [c["confirm_done"] for c in after] == [0, 1, 2, 3, 4]
    assert all(c["confirm_planned"] == 4 for c in after[1:])
    for c in after:
        remaining = end - c["elapsed_s"]
        assert 0.5 * remaining - 0.25 <= c["time_left_s"] <= 2 * remaining + 1.0, (c, remaining)
    assert calls[-1]["time_left_s"] == 0 and calls[-1]["confirm_done"] == 4


def test_the_confirmation_round_starts_no_trial_its_config_s_own_trials_say_would_overrun_the_budget(tmp_path,
                                                                                                     monkeypatch):
    """The round started a finalist's trial whenever any of time_budget_s was left, and a job whose last search
    trial ended near its budget overran it by a whole trial. Here the pick (b=4) takes 5 s a trial, and its search
    trial ends with about 5 s of a 10 s budget left: the round does not start it again, says why, and the job ends
    within its budget."""
    import sltune.executors.local as local
    from tests.support.fake_trials import FakeTrials

    monkeypatch.setattr(local, "run_trial", FakeTrials({1: 500.0, 4: 1000.0}, wall={1: 0.01, 4: 5.0}))
    spec = {**SPEC, "name": "late", "search": {**SPEC["search"], "strategy": "grid", "sub_batch_size": [1, 4],
                                               "num_sub_batches": [1], "num_live_blocks": [1], "max_trials": 2,
                                               "confirm_rounds": 2, "time_budget_s": 10}}
    r = tune(spec, f"sqlite:///{tmp_path / 'jobs.db'}", settings=Settings(data_dir=tmp_path))
    assert r["status"] == "succeeded", r
    assert [t["config"]["sub_batch_size"] for t in r["trials"] if t["role"] == "confirm"].count(4) == 0, r["trials"]
    assert "confirmation cut short: the " in r["stop_reason"], r["stop_reason"]
    assert "s left of time_budget_s (10s) are fewer than a trial of " in r["stop_reason"], r["stop_reason"]
    assert r["wall_seconds"] < 10, r["wall_seconds"]
