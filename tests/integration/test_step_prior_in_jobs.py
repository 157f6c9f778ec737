"""A tuning job on a machine whose rates `sltune calibrate SPEC` stored: every trial records the step the step-time
prior predicted for it before it ran, corrected by the trials before it (sltune.tuning.cost.correction), and its
page shows it beside what it measured. Real calibration, real trials, a real SQLite store."""

from __future__ import annotations

import pytest
import yaml

from sltune.service.local import tune
from sltune.settings import Settings
from sltune.store import Store
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.cost.stored_rates import stored_rates
from sltune.tuning.search.state import FinishedTrial, SearchState
from sltune.tuning.space import Candidate, SearchSpace
from tests.support.cli import sltune
from tests.support.specs import admitted_spec

SPEC = {"name": "prior", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
        "search": {"strategy": "grid", "sub_batch_size": [1, 2], "num_sub_batches": [1], "num_live_blocks": [1, 2],
                   "trial_steps": 1, "trial_min_time_s": 0.2, "confirm_rounds": 0}}


def test_a_job_predicts_each_trial_s_step_from_the_stored_rates_its_earlier_trials_correct(tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC))
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    made = sltune("calibrate", str(spec_file), "--db", db, "--budget", "3", "--offload-dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    result = tune(SPEC, db, settings=Settings(data_dir=tmp_path / "data"))
    assert result["status"] == "succeeded", result["error"]
    trials = [t for t in result["trials"] if t["status"] == "ok"]
    assert len(trials) == 4
    # what the job's state predicted for each trial, given the trials before it: replayed here from the record
    spec = admitted_spec(SPEC)
    shape = shape_of("llama-tiny")
    rates = stored_rates(Store(db), spec)
    assert rates is not None
    replay = SearchState(spec, shape, SearchSpace(spec, shape), rates=rates)
    for t in sorted(trials, key=lambda t: t["number"]):
        stored = Store(db).trial(result["job_id"], t["number"]).predicted
        c = Candidate.from_knobs(t["config"])
        expected = replay.predict(c).prior_step
        assert stored["prior_step_seconds"] == pytest.approx(expected.seconds)
        assert sum(stored["prior_breakdown"].values()) == pytest.approx(1.0)
        if replay.corrections.get("speedloader"):      # from the second trial on: corrected by the ones before it
            assert expected.seconds != pytest.approx(replay.step_prior(c, corrected=False).seconds)
        replay.add(FinishedTrial(t["number"], c, t["role"], Store(db).trial(result["job_id"], t["number"]).result))
    # the result says how far the trials moved the rates: what the replay's correction is after all of them
    moved = result["step_prior"]["corrections"]["speedloader"]
    assert moved == replay.corrections["speedloader"].to_dict() and moved["trials"] == 4
    assert result["step_prior"]["rates"] == rates.where()
    # each trial's page: the step predicted from the rates beside the one measured, and its predicted pie
    from fastapi.testclient import TestClient

    from sltune.api.app import create_app

    last = Store(db).trial(result["job_id"], max(t["number"] for t in trials))
    predicted, step = last.predicted, last.result["step_seconds"]
    with TestClient(create_app(Settings(data_dir=tmp_path / "data", db=db))) as client:
        text = client.get(f"/dashboard/jobs/{result['job_id']}/trials/{last.number}").text
        job_page = client.get(f"/dashboard/jobs/{result['job_id']}").text
        detail = client.get(f"/jobs/{result['job_id']}").json()
    assert detail["step_prior"] == result["step_prior"]
    assert "<dt>step-time prior</dt><dd>from rates calibrated" in job_page and \
        f"speedloader {moved['text']}".replace("'", "&#x27;") in job_page
    off = step / predicted["prior_step_seconds"] - 1
    assert (f"<tr><th>step seconds, from calibrated rates</th><td class='num'>{step:,.4f}</td>"
            f"<td class='num'>{predicted['prior_step_seconds']:,.4f}</td>"
            f"<td class='num'>{off:+.1%}</td></tr>") in text
    assert text.count('"hole":0.3') == 2 and "predicted before it ran" in text


def test_a_job_asked_to_measure_the_rates_measures_them_first_and_is_guided_by_them(tmp_path):
    """search.step_prior measure on a machine without rates: the job calibrates before its first trial (saying so in
    its progress, within its time budget), stores the rates for the next job, and oneshot then runs no probes: it
    measures the top predicted configs, corrected as they run, and stops by itself well short of the space. (The time
    budget leaves calibration 30 s, of which it takes some 7 on 2 idle cores; CI beside other work ran out of a
    budget of 60 s after one trial.)"""
    spec = {**SPEC, "name": "guided", "search": {**SPEC["search"], "strategy": "oneshot", "step_prior": "measure",
                                                 "sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2],
                                                 "time_budget_s": 300}}
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    seen: list[dict] = []
    result = tune(spec, db, settings=Settings(data_dir=tmp_path / "data"), progress=seen.append)
    assert result["status"] == "succeeded", result["error"]
    notes = [p.get("note", "") for p in seen if p["phase"] == "calibrating"]
    assert notes and "measuring this machine's rates" in notes[0] and any("calibrate: " in n for n in notes)
    first = next(i for i, p in enumerate(seen) if (p.get("last_trial") or {}).get("status") == "running")
    assert all(p["phase"] != "calibrating" for p in seen[first:])        # measured once, before the first trial
    rates = stored_rates(Store(db), admitted_spec(spec))
    assert rates is not None and result["step_prior"]["guided"] is True
    search = [t for t in result["trials"] if t["role"] != "confirm"]
    assert {t["role"] for t in search} == {"frontier"} and len(search) < 12, search
    assert "corrected step-time prior" in result["stop_reason"], result["stop_reason"]
    # the first trial is the config the stored rates predict fastest (before any trial corrects them)
    shape = shape_of("llama-tiny")
    replay = SearchState(admitted_spec(spec), shape, SearchSpace(admitted_spec(spec), shape), rates=rates)
    top = max(replay.space.candidates, key=lambda c: (replay.step_prior(c).tokens_per_s, c.batch, c.sub_batch_size))
    assert Candidate.from_knobs(search[0]["config"]) == top
    # the same job with a trial timeout every config's predicted steps outlast: no trial starts, only to time out
    quickest = min(replay.trial_seconds(c) for c in replay.space.candidates)
    short = {**spec, "name": "too-slow", "search": {**spec["search"], "trial_timeout_s": quickest / 2}}
    ended = tune(short, db, settings=Settings(data_dir=tmp_path / "data"))
    assert ended["status"] == "failed" and ended["trials"] == [], ended
    assert ended["stop_reason"].startswith("no trial ran: every untried config that fits is predicted to outlast "
                                           f"search.trial_timeout_s {quickest / 2:g}s"), ended["stop_reason"]


def test_a_generation_job_is_guided_by_its_predicted_generate_calls(tmp_path):
    """Generation too: a job measuring its rates at the generate spec (decode steps among them) runs no probes, and
    its first trial is the config whose generate call the rates predict fastest per token."""
    spec = {"name": "guided-generation", "model": {"preset": "llama-tiny"},
            "workload": {"mode": "generate", "prompt_len": 16, "new_tokens": 8},
            "search": {"strategy": "oneshot", "step_prior": "measure", "sub_batch_size": [1, 2, 4],
                       "num_sub_batches": [1, 2], "num_live_blocks": [1, 2], "kv_cache": ["host"],
                       "weights_on_device": [0.0, 1.0], "trial_steps": 1, "trial_min_time_s": 0.2,
                       "confirm_rounds": 0, "time_budget_s": 300}}
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    result = tune(spec, db, settings=Settings(data_dir=tmp_path / "data"))
    assert result["status"] == "succeeded", result["error"]
    assert result["step_prior"]["guided"] is True
    rates = stored_rates(Store(db), admitted_spec(spec))
    assert rates is not None and rates.decode_attention
    search = [t for t in result["trials"] if t["role"] != "confirm"]
    assert {t["role"] for t in search} == {"frontier"}, search
    shape = shape_of("llama-tiny")
    replay = SearchState(admitted_spec(spec), shape, SearchSpace(admitted_spec(spec), shape), rates=rates)
    top = max(replay.space.candidates, key=lambda c: (replay.step_prior(c).tokens_per_s, c.batch, c.sub_batch_size))
    assert Candidate.from_knobs(search[0]["config"]) == top
    assert Store(db).trial(result["job_id"], search[0]["number"]).predicted["prior_tokens_per_s"] == \
        pytest.approx(replay.step_prior(top).tokens_per_s)


def test_calibrating_for_a_spec_s_threads_gives_the_process_its_own_back(tmp_path):
    """A worker runs job after job in one process: one job's hardware.cpu_threads must not become the threads the next
    job's calibration measures at (nor its key). The second call finds what the first stored."""
    import torch

    from sltune.tuning.cost.stored_rates import calibrated

    spec = admitted_spec({**SPEC, "hardware": {"cpu_threads": 1}})
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rates, measured = calibrated(store, spec, tmp_path, budget_s=1.0)
        assert measured and rates.threads == 1 and torch.get_num_threads() == 2
        again, measured = calibrated(store, spec, tmp_path, budget_s=1.0)
        assert not measured and again == rates and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
